"""``--link-rate``: remote paths over a link slower than memory, in a namespace of their
own (root), because over loopback TCP moves bytes as fast as the CPUs copy them."""
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


def enter(rate: str, argv: list[str]) -> int:
    """This command again in a network namespace of its own; its exit status."""
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
    """Bring loopback up shaped to ``rate``; what tc says the qdisc is."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    # A 1 MB bucket: more is a head start after a pause that no real link gives; the
    # queue holds 100 ms of the rate, so shaping delays and never drops.
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
                    "burst", "1mb", "latency", "100ms"], check=True)
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], check=True,
                          capture_output=True, text=True).stdout.strip()


def sent_bytes() -> int:
    """Bytes through the shaper so far: what the remote paths moved over the link."""
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], check=True,
                         capture_output=True, text=True).stdout
    m = re.search(r"Sent (\d+) bytes", out)
    return int(m.group(1)) if m else 0
