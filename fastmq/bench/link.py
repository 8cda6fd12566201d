"""``--link-rate``: the remote (TCP) paths over a link slower than memory.

Over loopback TCP moves bytes as fast as the CPUs copy them, so the
writer's pass for its tags adds to the time; between nodes a NIC sets the
pace and a tag is computed while the segment before it is on the wire.  To
measure that on one machine the run gets a network namespace of its own
(``unshare -n``: root) whose loopback is shaped to the rate (``tc ... tbf``).
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
    """``text`` as tc writes a rate (``25gbit``, ``400mbit``)."""
    rate = text.strip().lower()
    if not _RATE.match(rate):
        raise ValueError(f"--link-rate {text!r}: expected a rate like 10gbit, 25gbit, "
                         "400mbit")
    return rate


def inside() -> str | None:
    """The rate this process's run is shaped to (in its namespace), or None."""
    return os.environ.get(ENV) or None


def enter(rate: str, argv: list[str]) -> int:
    """This command again in a network namespace of its own; its exit status
    (``RuntimeError``: why that cannot be done here)."""
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
    """Bring this namespace's loopback up, shaped to ``rate``; what ``tc``
    says the queue discipline is (kept with the figures).

    A 1 MB bucket: what passes at memory speed after a pause is a head start
    no real link gives (4 MB gave a quarter of a 16 MiB message one); the
    queue behind holds 100 ms of the rate, so shaping delays, never drops."""
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
