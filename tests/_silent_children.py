"""A second "node" whose link can be cut, for tests/test_silent_peers.py.

``SilentNode`` makes a network namespace joined to this one by a veth pair
(root); a spawned child enters it (``enter``) and runs one end of a queue
there.  ``cut()`` sets the namespace's end of the link down, so that once
the child is then SIGKILLed nothing leaves that node: no FIN, no reset,
as when a node dies or its link goes.  ``close()`` removes the namespace
and the pair, whatever happened.

The targets below are spawnable children; each reports on its pipe.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import time

CLONE_NEWNET = 0x40000000
_count = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class SilentNode:
    """A namespace ``name`` whose address is ``node_ip``; this side of the
    link is ``host_ip``."""

    def __init__(self):
        n = next(_count)
        tag = f"{os.getpid() % 10000}{n}"
        self.name = f"fmq-silent-{tag}"
        self.host_dev, self.node_dev = f"fsh{tag}", f"fsn{tag}"
        octet = 100 + (os.getpid() + n) % 150
        self.host_ip, self.node_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_dev, "type", "veth", "peer", "name", self.node_dev)
            _ip("link", "set", self.node_dev, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_dev)
            _ip("link", "set", self.host_dev, "up")
            _ip("-n", self.name, "addr", "add", f"{self.node_ip}/24", "dev", self.node_dev)
            _ip("-n", self.name, "link", "set", self.node_dev, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def cut(self) -> None:
        """Nothing leaves the node from now on (nor reaches it)."""
        _ip("-n", self.name, "link", "set", self.node_dev, "down")

    def close(self) -> None:
        _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.host_dev, check=False)


def enter(name: str) -> None:
    """This process's network is namespace ``name`` from now on."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def _env(env: dict) -> None:
    os.environ.update(env)


def writer(ns: str | None, ip: str, n_reader: int, handshake: bool, conn, env: dict):
    """A remote writer at ``ip`` (in namespace ``ns``): the handle, then
    (``handshake``) wait_until_ready() and one message on "send"; else it
    waits in wait_until_ready() for readers that do not all come."""
    _env(env)
    if ns is not None:
        enter(ns)
    from fastmq import MessageQueue

    mq = MessageQueue(n_reader, 0, connect_ip=ip)
    conn.send(mq.export_handle())
    if not handshake:
        # What the writer logs while it waits (a reader it dropped): each
        # line at once, ("log", time.monotonic(), line), and all of them
        # with "ready".
        import logging
        import threading

        lines = []
        lock = threading.Lock()

        class Keep(logging.Handler):
            def emit(self, record):
                line = record.getMessage()
                with lock:
                    lines.append(line)
                    conn.send(("log", time.monotonic(), line))

        logging.getLogger("fastmq").addHandler(Keep())
        try:
            mq.wait_until_ready()
            with lock:
                conn.send(("ready", list(lines)))
        except BaseException as e:
            with lock:
                conn.send(("raised", repr(e)))
        time.sleep(3600)
    mq.wait_until_ready()
    conn.send("ready")
    while True:
        what = conn.recv()
        mq.enqueue(what)
        conn.send("sent")


def stalled_reader(ns: str | None, handle, rank: int, conn, env: dict):
    """A remote reader (in namespace ``ns``) that reads one message, says
    so, and then reads nothing more (alive, its heartbeats going)."""
    _env(env)
    if ns is not None:
        enter(ns)
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    conn.send(("ready", os.getpid()))
    conn.send(("got", mq.dequeue(timeout=30)[:8]))
    time.sleep(3600)


def handshaking_reader(ns: str | None, handle, rank: int, conn, env: dict):
    """A remote reader that connects (its hello goes at once) and then
    waits in wait_until_ready(); it reports how that ended."""
    _env(env)
    if ns is not None:
        enter(ns)
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    conn.send(("attached", os.getpid()))
    try:
        mq.wait_until_ready()
        conn.send(("ready", None))
        while True:
            conn.send(("got", mq.dequeue()[:8]))
    except BaseException as e:
        conn.send(("raised", e))


def reading_reader(handle, rank: int, conn, env: dict):
    """A remote reader that reads everything until the writer closes the
    queue, then sends what it got, in order (or the error that ended it)."""
    _env(env)
    from fastmq import MessageQueue
    from fastmq._gone import WriterGoneError

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    conn.send(("ready", os.getpid()))
    got = []
    try:
        while True:
            got.append(mq.dequeue()[:8])
    except WriterGoneError as e:
        conn.send(("got", got, e.clean, str(e)))
    except BaseException as e:
        conn.send(("got", got, None, repr(e)))


def filling_writer(ip: str, handle_conn, env: dict):
    """A writer with two remote readers (rank 0 stalls, rank 1 reads):
    enqueue() 1 MiB messages on "go" until one raises; report each
    returned one, and how the last ended and when."""
    _env(env)
    from fastmq import MessageQueue
    from fastmq._gone import ReaderGoneError

    mq = MessageQueue(2, 0, connect_ip=ip)
    handle_conn.send(mq.export_handle())
    mq.wait_until_ready()
    handle_conn.send("ready")
    mq.enqueue(b"m0000000" + bytes(1 << 20))
    handle_conn.send(("returned", 0, time.monotonic()))
    handle_conn.recv()     # "go": rank 0 has stopped reading
    i = 1
    try:
        while True:
            mq.enqueue(b"m%07d" % i + bytes(1 << 20))
            handle_conn.send(("returned", i, time.monotonic()))
            i += 1
    except ReaderGoneError as e:
        handle_conn.send(("raised", i, time.monotonic(), e.rank, e.pid, e.how, str(e),
                          getattr(e, "__notes__", [])))
    except BaseException as e:
        handle_conn.send(("raised", i, time.monotonic(), None, None, None, repr(e), []))
    handle_conn.recv()     # "close": the queue goes, the end of the stream with it
    import gc
    del mq
    gc.collect()
    handle_conn.send("closed")


# -- vLLM across a link that can be cut (tests/test_vllm_silent_node.py) --------------
# As tests/_multinode_worker.py's two nodes (its worker class), but the
# nodes talk over the veth pair: node 0 (engine, worker 0) in the
# namespace, node 1 (headless, worker 1) on this side.  The addresses come
# from the environment (FASTMQ_TEST_MASTER_ADDR, VLLM_HOST_IP, GLOO_SOCKET_IFNAME).
def _vllm_config(node_rank: int):
    from _vllm_models import tiny_model
    from vllm.engine.arg_utils import EngineArgs

    model = tiny_model(os.environ["FASTMQ_TEST_MODEL_DIR"])
    args = EngineArgs(model=model, skip_tokenizer_init=True, tensor_parallel_size=2,
                      distributed_executor_backend="mp",
                      worker_cls="_multinode_worker.MultiNodeWorker", enforce_eager=True,
                      max_model_len=256, nnodes=2, node_rank=node_rank,
                      master_addr=os.environ["FASTMQ_TEST_MASTER_ADDR"],
                      master_port=int(os.environ["FASTMQ_TEST_MASTER_PORT"]))
    return args.create_engine_config(headless=node_rank > 0)


def vllm_engine() -> None:
    """Node 0: the executor, then round trips through both workers without
    end (BUSY once they run), until it is killed or one raises: then
    RAISED with the error and how long after the first BUSY, and what is
    left after vLLM's shutdown."""
    import gc
    import json

    import _executor_worker as ew
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    executor = MultiprocExecutor(_vllm_config(0))
    workers = executor.collective_rpc("queues")
    pids = [w["pid"] for w in workers]
    i = 0
    try:
        while True:
            assert executor.collective_rpc("echo", args=(i,)) == [i, i]
            i += 1
            if i == 20:
                print("BUSY " + json.dumps({"engine_pid": os.getpid(), "worker_pids": pids,
                                            "at": time.time()}), flush=True)
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}", "at": time.time(), "calls": i}
    print("RAISED " + json.dumps(out), flush=True)
    executor.shutdown()
    del executor
    gc.collect()
    out["alive_after_shutdown"], _ = ew.still_alive(pids[:1])
    print("RESULT " + json.dumps(out), flush=True)


def vllm_headless() -> None:
    """Node 1: as ``vllm serve --nnodes 2 --node-rank 1 --headless``; when
    it ends, how, and what is left on this node."""
    from _multinode_worker import serve_headless
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    serve_headless(lambda: MultiprocExecutor(_vllm_config(1), monitor_workers=False))


# -- real generation across the link (vLLM's CPU build) --------------------------------
def _gen_two_node_args() -> dict:
    return {"nnodes": 2, "master_addr": os.environ["FASTMQ_TEST_MASTER_ADDR"],
            "master_port": int(os.environ["FASTMQ_TEST_MASTER_PORT"])}


def gen_node0() -> None:
    """Node 0: the front process (engine core, worker 0), generating
    without end; GENERATING once the first batch is out."""
    import json

    import _vllm_models as g

    os.environ.update({k: v for k, v in g.GEN_ENGINE_ENV.items() if k not in os.environ})
    llm = g.make_llm(os.environ["FASTMQ_TEST_MODEL_DIR"], 2, node_rank=0,
                     **_gen_two_node_args())
    first = True
    while True:
        g.generate(llm, g.PROMPTS, 64)
        if first:
            print("GENERATING " + json.dumps({"front": os.getpid(), **g.engine_pids()}),
                  flush=True)
            first = False


def gen_node1() -> None:
    """Node 1: as ``vllm serve --nnodes 2 --node-rank 1 --headless``; when
    it ends, how, and what is left on this node."""
    import _vllm_models as g

    os.environ.update({k: v for k, v in g.GEN_ENGINE_ENV.items() if k not in os.environ})
    from _multinode_worker import serve_headless
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    args = EngineArgs(model=os.environ["FASTMQ_TEST_MODEL_DIR"], tensor_parallel_size=2,
                      **g.ENGINE_ARGS, node_rank=1, **_gen_two_node_args())
    serve_headless(lambda: MultiprocExecutor(args.create_engine_config(headless=True),
                                             monitor_workers=False))
