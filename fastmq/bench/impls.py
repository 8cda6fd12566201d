"""The implementations measured, behind the writer/reader interface the harness uses."""
from __future__ import annotations

import gc
import inspect
import os
import pickle
import secrets
import tempfile
from dataclasses import dataclass, field

REMOTE_IP = "127.0.0.1"


@dataclass(frozen=True)
class Impl:
    name: str
    family: str                 # fastmq | vllm | pyzmq | floor
    description: str
    wait_mode: str | None = None
    arena: bool | None = None
    remote: str = ""            # "" | "readers" | "both"
    remote_kwargs: dict = field(default_factory=dict)  # fastmq's security

    @property
    def spin_s(self) -> float | None:
        """How long an idle reader spins before it parks (None: never parks)."""
        if self.family == "fastmq":
            if self.wait_mode == "spin":
                return None
            from fastmq import _config

            return _config.spin_us(None) / 1e6
        if self.family == "vllm":
            from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

            return float(inspect.signature(SpinCondition.__init__)
                         .parameters["busy_loop_s"].default)
        return 0.0

    def _kwargs(self, arena) -> dict:
        # Explicit (fastmq turns the arena on for local queues): answer
        # queues never carry tensors.
        return {"wait_mode": self.wait_mode or "futex", "enable_shm_tensor_arena": bool(arena)}

    def make_writer(self, n_readers: int, capacity: int = 0):
        if self.family == "fastmq":
            return _QueueWriter(self, _fastmq_mq(), n_readers, self._kwargs(self.arena))
        if self.family == "vllm":
            kw = {} if self.remote else {"enable_shm_tensor_arena": bool(self.arena)}
            return _QueueWriter(self, _vllm_mq(), n_readers, kw)
        if self.family == "pyzmq":
            return _ZmqWriter(n_readers)
        if self.family == "floor":
            return _FloorWriter(self, n_readers, capacity)
        raise ValueError(f"unknown implementation family {self.family!r}")

    def open_reader(self, spec, rank: int):
        if self.family == "pyzmq":
            return _ZmqReader(spec, rank)
        if self.family == "floor":
            return _FloorReader(self, spec, rank)
        if self.family in ("fastmq", "vllm"):
            fastmq = self.family == "fastmq"
            return _QueueReader(self, _fastmq_mq() if fastmq else _vllm_mq(), spec, rank,
                                self._kwargs(False) if fastmq else {})
        raise ValueError(f"unknown implementation family {self.family!r}")


def _fastmq_mq():
    from fastmq import MessageQueue

    return MessageQueue


def _vllm_mq():
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    if not MessageQueue.__module__.startswith("vllm."):
        # fastmq's vLLM hook swapped it in: we would compare fastmq with itself.
        raise RuntimeError(
            "vLLM's MessageQueue is replaced by fastmq in this process "
            f"({MessageQueue.__module__}); run the benchmark with FASTMQ_VLLM=0")
    return MessageQueue


_SHAPES = {"readers": ("-remote", "every reader remote (TCP over loopback)"),
           "both": ("-remote-both", "remote both ways (TCP over loopback): every reader "
                    "remote, and so is each answer queue's reader (vLLM's multi-node "
                    "executor)")}
_SECURITY = (("", {}, "default security: a keyed MAC on every message"),
             ("+encrypt", {"remote_security": "encrypt"}, "AES-GCM encryption"),
             ("+plain", {"remote_security": "none"}, "plain TCP, unauthenticated"))
_FUTEX = {"wait_mode": "futex", "arena": False}

IMPLS: dict[str, Impl] = {i.name: i for i in [
    Impl("fastmq-futex", "fastmq", "fastmq, readers spin briefly then park on a futex",
         **_FUTEX),
    Impl("fastmq-zmq", "fastmq", "fastmq, readers spin briefly then park on a ZMQ socket",
         wait_mode="zmq", arena=False),
    Impl("fastmq-spin", "fastmq", "fastmq, readers spin (never park)",
         wait_mode="spin", arena=False),
    Impl("fastmq-futex+arena", "fastmq", "fastmq (futex) with the shared-memory tensor arena",
         wait_mode="futex", arena=True),
    Impl("vllm", "vllm", "vLLM 0.33.0 MessageQueue (its default: no tensor arena)",
         arena=False),
    Impl("vllm+arena", "vllm", "vLLM 0.33.0 MessageQueue with enable_shm_tensor_arena=True",
         arena=True),
    *[i for shape, (suffix, what) in _SHAPES.items() for i in [
        *[Impl(f"fastmq{suffix}{tag}", "fastmq", f"fastmq, {what}; {security}", **_FUTEX,
               remote=shape, remote_kwargs=kwargs) for tag, kwargs, security in _SECURITY],
        Impl(f"vllm{suffix}", "vllm", f"vLLM 0.33.0 MessageQueue, {what}", arena=False,
             remote=shape)]],
    Impl("pyzmq", "pyzmq", "plain pyzmq: PUB/SUB broadcast, PUSH/PULL answers, ipc, "
         "blocking recv"),
    Impl("floor", "floor", "floor: bare shared memory, no queue (see the notes)"),
    Impl("floor-futex", "floor", "floor: a C reader parked in FUTEX_WAIT, woken by a C "
         "writer that slept as long"),
    Impl("floor-pipe", "floor", "floor: a Python reader blocked in os.read() on a pipe, "
         "woken by a Python writer that slept as long"),
]}

# Each remote row's vLLM reference: remote of the same shape, whatever the security.
REMOTE_ROWS = {i.name: (None if i.family == "vllm" else "vllm" + _SHAPES[i.remote][0])
               for i in IMPLS.values() if i.remote}


def remote_notes(names) -> list[str]:
    """What the remote rows among ``names`` are (a table's notes)."""
    if not any("-remote" in n for n in names):
        return []
    return ["-remote: every reader of the broadcast is a remote reader (TCP over loopback, "
            "on this machine's cores) and answers on a local 1:1 queue; -remote-both: remote "
            "both ways, as in vLLM's multi-node executor: each reader answers on a queue of "
            "its own whose reader (the writer) is remote too.",
            "security of fastmq's TCP path: fastmq-remote and fastmq-remote-both have the "
            "default, a keyed MAC authenticating every message; +encrypt: AES-GCM "
            "encryption; +plain: plain TCP, unauthenticated, the comparison for what the "
            "default costs. vLLM's remote path is plain TCP."]


def availability(impl: Impl) -> tuple[bool, str]:
    """(usable here, why not)."""
    from fastmq._ring import have_futex

    if impl.family == "vllm":
        try:
            _vllm_mq()
        except Exception as e:  # ImportError, or vLLM failing at import time
            return False, f"vLLM is not importable here ({type(e).__name__}: {e})"
        return True, ""
    if impl.family == "floor" and impl.name != "floor-pipe":
        try:
            from fastmq import _floor  # noqa: F401
        except ImportError as e:
            return False, (f"the C floor is not built ({e}): run `python setup.py "
                           "build_ext --inplace` or reinstall fastmq")
    if impl.family == "fastmq" and impl.remote:
        try:
            _fastmq_mq()(1, 0, connect_ip=REMOTE_IP, **impl.remote_kwargs).shutdown()
        except Exception as e:  # an unknown keyword is a TypeError naming it
            unknown = [k for k in impl.remote_kwargs if isinstance(e, TypeError) and k in str(e)]
            if unknown:
                return False, (f"this fastmq's MessageQueue takes no {'=, '.join(unknown)}= "
                               f"keyword: its remote path has no such setting ({e})")
            return False, f"a remote MessageQueue fails here: {type(e).__name__}: {e}"
        gc.collect()
    if ((impl.name == "floor-futex" or (impl.wait_mode == "futex" and not impl.remote))
            and not have_futex()):
        return False, "no futex support on this system"
    return True, ""


def _shutdown(*queues) -> None:
    for q in queues:
        try:
            q.shutdown()
        except Exception:
            pass
    gc.collect()


class _QueueWriter:
    """A MessageQueue (fastmq's and vLLM's share the surface)."""

    def __init__(self, impl: Impl, mq_cls, n_readers: int, kwargs: dict):
        self.impl = impl
        self._cls = mq_cls
        if impl.remote:
            self._mq = mq_cls(n_readers, 0, connect_ip=REMOTE_IP, **kwargs,
                              **impl.remote_kwargs)
        else:
            self._mq = mq_cls(n_readers, n_readers, **kwargs)
        self.spec = self._mq.export_handle()
        # fastmq builds without an arena ignore the switch.
        self.arena_active = getattr(self._mq, "tensor_arena", None) is not None
        self._acks: list = []
        self._ack_specs: list = []

    def attach_acks(self, specs: list) -> None:
        self._ack_specs = list(specs)
        # Remote both ways: attach as a remote reader, as vLLM's executor does.
        rank = -1 if self.impl.remote == "both" else 0
        self._acks = [self._cls.create_from_handle(h, rank) for h in specs]

    def ready(self) -> None:
        self._mq.wait_until_ready()
        for a in self._acks:
            a.wait_until_ready()

    def send(self, obj, timeout: float) -> None:
        self._mq.enqueue(obj, timeout=timeout)

    def ack(self, rank: int, timeout: float):
        return self._acks[rank].dequeue(timeout=timeout)

    def close(self) -> None:
        # Collecting the queues releases (and, as creator, unlinks) their segments.
        _shutdown(self._mq, *self._acks)
        self._mq = None
        self._acks = []
        gc.collect()
        if self.impl.family == "vllm":
            # vLLM leaves its ipc socket files behind, every socket on them closed by now.
            for h in [self.spec, *self._ack_specs]:
                for addr in (h.local_subscribe_addr, h.local_notify_addr):
                    if addr and addr.startswith("ipc://"):
                        try:
                            os.unlink(addr[len("ipc://"):])
                        except OSError:
                            pass


class _QueueReader:
    def __init__(self, impl: Impl, mq_cls, spec, rank: int, ack_kwargs: dict):
        self._mq = mq_cls.create_from_handle(spec, rank)
        if impl.remote == "both":  # a remote worker's answer queue
            self._resp = mq_cls(1, 0, connect_ip=REMOTE_IP, **ack_kwargs,
                                **impl.remote_kwargs)
        else:
            self._resp = mq_cls(1, 1, **ack_kwargs)
        self.ack_spec = self._resp.export_handle()

    def ready(self) -> None:
        self._mq.wait_until_ready()
        self._resp.wait_until_ready()

    def recv(self, timeout: float):
        return self._mq.dequeue(timeout=timeout)

    def reply(self, obj, timeout: float) -> None:
        self._resp.enqueue(obj, timeout=timeout)

    def close(self) -> None:
        _shutdown(self._mq, self._resp)
        self._mq = self._resp = None
        gc.collect()


def _ipc_path() -> tuple[str, str]:
    # Named like fastmq's own, so the test suite's leftover check covers them.
    path = os.path.join(tempfile.gettempdir(),
                        f"fastmq_bench_{os.getpid()}_{secrets.token_hex(6)}.ipc")
    return f"ipc://{path}", path


class _ZmqWriter:
    """Plain pyzmq at its best; a blocking recv: a timeout costs 15 us a round trip."""

    needs_watchdog = True

    def __init__(self, n_readers: int):
        import zmq

        from fastmq import segments
        from fastmq._serde import Encoder

        self._n = n_readers
        self._encoder = Encoder()
        self._ctx = zmq.Context()
        self._paths: list[str] = []
        self._pulls: list = []
        try:
            self._pub = self._ctx.socket(zmq.XPUB)
            # Every reader's subscription reaches ready(), not only a topic's first.
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            # PUB drops past its high-water mark, and a dropped message fails the run.
            self._pub.setsockopt(zmq.SNDHWM, 0)
            addrs = []
            self._pulls = [self._ctx.socket(zmq.PULL) for _ in range(n_readers)]
            for sock in [self._pub, *self._pulls]:
                addr, path = _ipc_path()
                self._paths.append(path)
                sock.bind(addr)
                addrs.append(addr)
        except BaseException:
            self.close()
            raise
        segments.remove_at_exit(self._paths)
        self.spec = (addrs[0], addrs[1:])

    def attach_acks(self, specs: list) -> None:
        pass  # the PULL sockets are bound already

    def ready(self) -> None:
        # One subscription per reader: then nothing published is missed (slow joiners).
        for _ in range(self._n):
            self._pub.recv()

    def send(self, obj, timeout: float) -> None:
        frames = self._encoder.encode(obj)
        if len(frames) == 1:
            self._pub.send(frames[0])
        else:
            self._pub.send_multipart(frames, copy=False)

    def ack(self, rank: int, timeout: float):
        return pickle.loads(self._pulls[rank].recv())

    def close(self) -> None:
        from fastmq import segments

        for s in [getattr(self, "_pub", None), *self._pulls]:
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
        segments.remove_now(self._paths)


class _ZmqReader:
    ack_spec = None

    def __init__(self, spec, rank: int):
        import zmq

        from fastmq._serde import decode

        self._zmq = zmq
        self._decode = decode
        pub_addr, pull_addrs = spec
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(pub_addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(pull_addrs[rank])

    def ready(self) -> None:
        pass

    def recv(self, timeout: float):
        # No timeout (see _ZmqWriter): the harness stops a reader left waiting.
        zmq, sub = self._zmq, self._sub
        main = sub.recv()
        oob = []
        while sub.get(zmq.RCVMORE):
            oob.append(sub.recv(copy=False).buffer)
        return self._decode(main, oob)

    def reply(self, obj, timeout: float) -> None:
        self._push.send(pickle.dumps(obj, protocol=5))

    def close(self) -> None:
        self._sub.close(linger=0)
        self._push.close(linger=0)
        self._ctx.term()


class _FloorRef(tuple):
    """Stands for the tensor copied into the floor segment: (nbytes, dtype, shape)."""


class _FloorWriter(_QueueWriter):
    """The tensor floor: one memcpy into a pre-faulted segment readers view in place."""

    def __init__(self, impl: Impl, n_readers: int, capacity: int):
        import numpy as np

        from fastmq import segments

        if capacity <= 0:
            raise ValueError("the floor needs the largest tensor size (capacity)")
        self._seg = segments.create_segment("bench", capacity, "the benchmark's floor buffer")
        try:
            self._view = np.frombuffer(self._seg, dtype=np.uint8)
            # Pre-fault now: the floor is the copy, not tmpfs allocating pages.
            self._view.fill(0)
            super().__init__(impl, _fastmq_mq(), n_readers, impl._kwargs(False))
        except BaseException:
            self._view = None
            self._release()
            raise
        self.spec = (self.spec, self._seg.name)
        self.arena_active = False

    def send(self, obj, timeout: float) -> None:
        import numpy as np
        import torch

        if isinstance(obj, tuple):
            parts = list(obj)
            for i, part in enumerate(parts):
                if hasattr(part, "element_size"):  # torch.Tensor: the one copy
                    src = part.reshape(-1).view(torch.uint8).numpy()
                    if src.size > self._view.size:
                        raise ValueError(f"tensor of {src.size} bytes exceeds the floor "
                                         f"segment ({self._view.size} bytes)")
                    np.copyto(self._view[:src.size], src)
                    parts[i] = _FloorRef((src.size, str(part.dtype)[6:], tuple(part.shape)))
            obj = tuple(parts)
        super().send(obj, timeout)

    def close(self) -> None:
        super().close()
        self._view = None
        self._release()

    def _release(self) -> None:
        from fastmq import segments

        segments.forget_segment(self._seg.name)
        self._seg.unlink()
        self._seg.close()


class _FloorReader(_QueueReader):
    def __init__(self, impl: Impl, spec, rank: int):
        from fastmq._segment import Segment

        q_spec, name = spec
        self._seg = Segment.attach(name)
        super().__init__(impl, _fastmq_mq(), q_spec, rank, impl._kwargs(False))

    def recv(self, timeout: float):
        import torch

        obj = super().recv(timeout)
        if not isinstance(obj, tuple):
            return obj
        # Zero copy: each tensor is the shared segment itself.
        return tuple(torch.frombuffer(self._seg, dtype=torch.uint8, count=p[0])
                     .view(getattr(torch, p[1])).view(p[2])
                     if isinstance(p, _FloorRef) else p for p in obj)

    def close(self) -> None:
        super().close()
        self._seg.close()
