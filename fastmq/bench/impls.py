"""The implementations measured: which MessageQueue, on which path, with which settings."""
from __future__ import annotations

import gc
import inspect
import os
from contextlib import suppress
from dataclasses import dataclass, field

REMOTE_IP = "127.0.0.1"
# The items of the +list rows' list: a large list of small in-band objects.
LIST_ITEM = 1024


@dataclass(frozen=True)
class Impl:
    name: str
    family: str                 # fastmq | vllm | floor (a floor runs on fastmq's queue)
    description: str
    arena: bool = False
    remote: str = ""            # "" | "readers" | "both"
    remote_kwargs: dict = field(default_factory=dict)  # fastmq's security
    # tensor: a torch tensor; bytes: the same bytes in-band; list: the same bytes
    # in-band as a list of LIST_ITEM-byte bytes objects
    payload: str = "tensor"

    @property
    def spin_s(self) -> float:
        """How long an idle reader spins before it parks."""
        if self.family == "fastmq":
            from fastmq import _config

            return _config.spin_us(None) / 1e6
        if self.family == "vllm":
            from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

            return float(inspect.signature(SpinCondition.__init__)
                         .parameters["busy_loop_s"].default)
        return 0.0

    def mq_class(self):
        if self.family != "vllm":
            from fastmq import MessageQueue

            return MessageQueue
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        if not MessageQueue.__module__.startswith("vllm."):
            # fastmq's vLLM hook swapped it in: we would compare fastmq with itself.
            raise RuntimeError(
                "vLLM's MessageQueue is replaced by fastmq in this process "
                f"({MessageQueue.__module__}); run the benchmark with FASTMQ_VLLM=0")
        return MessageQueue

    def queue(self, n_readers: int, answers: bool = False):
        """The writer's queue to ``n_readers`` readers, or a reader's queue of ``answers``
        (remote too when ``remote`` is "both", as a remote worker's in vLLM)."""
        arena = self.arena and not answers  # answer queues never carry tensors
        if self.family == "vllm":  # its remote queues take no arena switch
            kw = {} if self.remote else {"enable_shm_tensor_arena": arena}
        else:  # explicit: fastmq turns the arena on by itself, FASTMQ_WAIT may say otherwise
            kw = {"wait_mode": "futex", "enable_shm_tensor_arena": arena}
        if self.remote == "both" or (self.remote and not answers):
            return self.mq_class()(n_readers, 0, connect_ip=REMOTE_IP, **kw,
                                   **self.remote_kwargs)
        return self.mq_class()(n_readers, n_readers, **kw)


_SHAPES = {"readers": ("-remote", "every reader remote (TCP over loopback)"),
           "both": ("-remote-both", "remote both ways (TCP over loopback): every reader "
                    "remote, and so is each answer queue's reader (vLLM's multi-node "
                    "executor)")}
_SECURITY = (("", {}, "default security: a keyed MAC on every message"),
             ("+encrypt", {"remote_security": "encrypt"}, "AES-GCM encryption"),
             ("+plain", {"remote_security": "none"}, "plain TCP, unauthenticated"))

IMPLS: dict[str, Impl] = {i.name: i for i in [
    Impl("fastmq-futex", "fastmq", "fastmq, readers spin briefly then park on a futex"),
    Impl("fastmq-futex+arena", "fastmq", "fastmq (futex) with the shared-memory tensor arena",
         arena=True),
    Impl("vllm", "vllm", "vLLM 0.33.0 MessageQueue (its default: no tensor arena)"),
    Impl("vllm+arena", "vllm", "vLLM 0.33.0 MessageQueue with enable_shm_tensor_arena=True",
         arena=True),
    *[i for shape, (suffix, what) in _SHAPES.items() for i in [
        *[Impl(f"fastmq{suffix}{tag}", "fastmq", f"fastmq, {what}; {security}",
               remote=shape, remote_kwargs=kwargs) for tag, kwargs, security in _SECURITY],
        Impl(f"vllm{suffix}", "vllm", f"vLLM 0.33.0 MessageQueue, {what}", remote=shape)]],
    *[Impl(f"{base}+{kind}", base.split("-")[0], f"{base}, {what} (pickled in-band)",
           remote="readers" if "remote" in base else "", payload=kind)
      for kind, what in (("bytes", "the tensor's bytes as one bytes object"),
                         ("list", f"the tensor's bytes as a list of {LIST_ITEM} B bytes objects"))
      for base in ("fastmq-futex", "vllm", "fastmq-remote", "vllm-remote")],
    Impl("floor", "floor", "floor: bare shared memory, no queue (see the notes)"),
    Impl("floor-futex", "floor", "floor: a C reader parked in FUTEX_WAIT, woken by a C "
         "writer that slept as long"),
    Impl("floor-pipe", "floor", "floor: a Python reader blocked in os.read() on a pipe, "
         "woken by a Python writer that slept as long"),
]}

# Each remote row's vLLM reference: remote of the same shape, whatever the security.
REMOTE_ROWS = {i.name: (None if i.family == "vllm" else "vllm" + _SHAPES[i.remote][0])
               for i in IMPLS.values() if i.remote and i.payload == "tensor"}


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
            impl.mq_class()
        except Exception as e:  # ImportError, or vLLM failing at import time
            return False, f"vLLM is not importable here ({type(e).__name__}: {e})"
    elif not impl.remote and not have_futex():
        return False, "no futex support on this system"
    return True, ""


def shutdown(queues: list, vllm_handles=()) -> None:
    """Shut ``queues`` down and drop them: collecting them releases their segments
    (vLLM's creator also unlinks its files)."""
    while queues:
        with suppress(Exception):
            queues.pop().shutdown()
    gc.collect()
    # vLLM leaves its ipc socket files behind, every socket on them closed by now.
    for h in vllm_handles:
        for addr in (h.local_subscribe_addr, h.local_notify_addr):
            if addr and addr.startswith("ipc://"):
                with suppress(OSError):
                    os.unlink(addr[len("ipc://"):])
