"""``--link-rate``: the remote (TCP) paths over a link slower than memory.

On one machine a remote reader talks to its writer over loopback, where
TCP moves bytes as fast as the two ends' CPUs copy them: the writer's
extra pass over a large message for its tags (the default security) then
adds to the time (a reader checks a segment while the next one comes).  Between nodes a NIC sets the
pace, and a tag is computed while the segment before it is on the wire.

To measure that case on one machine, the run happens in a network
namespace of its own (``unshare -n``: root), whose loopback is shaped with
a token bucket (``tc qdisc ... tbf``) to the given rate.  Both fastmq's and
vLLM's remote paths go through it; local paths (shared memory, unix
sockets) are unaffected.  The namespace ends with the run.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

ENV = "FASTMQ_BENCH_LINK"
_RATE = re.compile(r"^[1-9][0-9]*[kmg]?bit$")
TOOLS = ("unshare", "ip", "tc")


def parse_rate(text: str) -> str:
    """``text`` as tc writes a rate (``25gbit``, ``400mbit``), or a clear
    ``ValueError``."""
    rate = text.strip().lower()
    if not _RATE.match(rate):
        raise ValueError(f"--link-rate {text!r}: expected a rate like 10gbit, 25gbit, "
                         "400mbit")
    return rate


def inside() -> str | None:
    """The rate this process's run is shaped to (it is the namespace's
    first process), or None."""
    return os.environ.get(ENV) or None


def enter(rate: str, argv: list[str]) -> int:
    """Run this command again, in a child with a network namespace of its
    own and ``ENV`` set; its exit status.  ``RuntimeError`` saying why
    where that cannot be done here."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"--link-rate needs {', '.join(missing)} (util-linux, iproute2)")
    if os.geteuid() != 0:
        raise RuntimeError("--link-rate needs root: the run gets a network namespace of "
                           "its own, with tc on its loopback")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError("--link-rate: cannot make a network namespace here "
                           f"({probe.stderr.strip() or probe.returncode})")
    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.run(["unshare", "-n", "--", sys.executable, "-m", "fastmq.bench",
                           *argv], env=dict(os.environ, **{ENV: rate})).returncode


def shape(rate: str) -> str:
    """Bring this namespace's loopback up, shaped to ``rate``; what
    ``tc`` then says the queue discipline is (kept with the figures).

    The bucket holds 1 MB: what passes at memory speed after a pause, a
    head start no real link gives.  A 4 MB bucket made a quarter of a
    16 MiB message such a head start, and its figure partly a measure of
    the sender's speed.  On a 2-core machine the shaper stays somewhat
    below its rate with 1 MB, and further below with a smaller bucket
    (measured with scratch runs, not by the benchmark).  The queue behind it holds 100 ms of the
    rate, so the shaping delays, never drops."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
                    "burst", "1mb", "latency", "100ms"], check=True)
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], check=True,
                          capture_output=True, text=True).stdout.strip()


def sent_bytes() -> int:
    """Bytes this namespace's loopback has sent through the shaper so far
    (kept with the figures: what the remote paths moved over the link)."""
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], check=True,
                         capture_output=True, text=True).stdout
    m = re.search(r"Sent (\d+) bytes", out)
    return int(m.group(1)) if m else 0
