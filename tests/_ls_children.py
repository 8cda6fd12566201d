"""Child-process bodies for test_ls: a writer and readers held at known
positions, each waiting on its pipe for the next instruction; and, for
test_ls_hostile, another user's process holding memory files named like
fastmq's segments that are not what their name says."""
from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import struct
import threading
import time

import numpy as np

CHUNK = 64 << 10
CHUNKS = 4
ARRAY_BYTES = 1 << 20     # out of band (>= 1 MiB) and >= arena_min_mb: an arena slot


def message(i: int):
    if i == 2:
        return {"i": i, "array": np.full(ARRAY_BYTES // 8, i, dtype=np.int64)}
    return {"i": i}


def writer_main(conn, n_reader: int, n_msgs: int):
    from fastmq import MessageQueue

    mq = MessageQueue(n_reader, n_reader, max_chunk_bytes=CHUNK, max_chunks=CHUNKS,
                      wait_mode="futex", enable_shm_tensor_arena=True, arena_slots=2,
                      arena_slot_mb=2, arena_min_mb=1)
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    for i in range(n_msgs):
        mq.enqueue(message(i))
    # A slot used on cold pages has the arena pre-fault the next ones in a
    # background thread; the test wants an idle queue: let it finish.
    for t in threading.enumerate():
        if t.name == "fastmq-arena-prefault":
            t.join(60)
    conn.send("sent")
    conn.recv()                 # held here until told to exit (or killed)


def reader_main(conn, handle, rank: int, k: int):
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    for i in range(k):
        got = mq.dequeue(timeout=60)
        assert got["i"] == i, (rank, i, got)
        del got                 # releases an arena slot at once
    conn.send(("read", k))
    if conn.recv() == "park":
        # Nothing more comes: spins for spin_us, then parks on the futex.
        try:
            mq.dequeue(timeout=300)
        except RuntimeError:
            pass                # the writer died or shut down


NOBODY = 65534
PiB = 1 << 50
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Foreign:
    """A process of another user (``uid``) holding memory files named like
    fastmq's, one per spec, until ``stop()``:

    * ``("sparse", kind)``: 1 PiB, unsealed, no pages;
    * ``("sealed", kind)``: 1 PiB, sealed as fastmq seals, no header;
    * ``("forged", kind, magic, data_off)``: 1 PiB, sealed, a header with
      ``magic`` that says the segment is 1 PiB with its data at ``data_off``;
    * ``("truncating", kind)``: unsealed, cut to 0 bytes and grown to 1 MiB
      again and again by its holder, as fast as it can.

    Made with fork and setuid (the interpreter need not be reachable by that
    user), doing only system calls in the child."""

    def __init__(self, specs: list[tuple], uid: int = NOBODY):
        self.uid = uid
        names_r, names_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:       # the child: never returns
            os.close(names_r)
            os.close(self._stop_w)
            code = 1
            try:
                self._child(specs, names_w)
                code = 0
            except BaseException as e:
                os.write(names_w, json.dumps({"error": repr(e)}).encode() + b"\n")
            finally:
                os._exit(code)
        os.close(names_w)
        os.close(self._stop_r)
        try:
            with os.fdopen(names_r, "rb") as f:
                line = f.readline()
            got = json.loads(line) if line else {"error": "the child exited"}
            if "error" in got:
                raise RuntimeError(f"the foreign holder failed: {got['error']}")
            self.names: list[str] = got["names"]
        except BaseException:
            self.stop()
            raise

    def _child(self, specs, names_w):
        os.setgroups([])
        os.setresgid(self.uid, self.uid, self.uid)
        os.setresuid(self.uid, self.uid, self.uid)
        names, cutting = [], []
        for i, spec in enumerate(specs):
            how, kind = spec[0], spec[1]
            name = f"fastmq_{os.getpid()}_{kind}_{0xdead0000 + i:012x}"
            sealed = how in ("sealed", "forged")
            fd = os.memfd_create(name, os.MFD_CLOEXEC
                                 | (os.MFD_ALLOW_SEALING if sealed else 0))
            if how == "truncating":
                cutting.append(fd)
            else:
                os.ftruncate(fd, PiB)
            if how == "forged":
                magic, data_off = spec[2], spec[3]
                os.pwrite(fd, struct.pack("<Q32xQQ", magic, data_off, PiB), 0)
            if sealed:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            names.append(name)
        os.write(names_w, json.dumps({"names": names}).encode() + b"\n")
        os.close(names_w)
        while True:
            if cutting:
                for _ in range(64):
                    for fd in cutting:
                        os.ftruncate(fd, 1 << 20)
                        os.pwrite(fd, b"\x01" * 4096, 0)
                        os.ftruncate(fd, 0)
                if select.select([self._stop_r], [], [], 0)[0]:
                    return
            elif select.select([self._stop_r], [], [], None)[0]:
                return

    def stop(self) -> None:
        """Ends the child (its files go with it) and reaps it."""
        if self._stop_w >= 0:
            os.close(self._stop_w)
            self._stop_w = -1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return
            time.sleep(0.01)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def demo() -> str:
    """The ``fastmq ls`` output in docs/operations.md: the queue test_ls
    builds (readers that read 3, 1 and 0 of 3 messages; reader 0 then
    parked, reader 2 killed), listed alone so that other queues on the host
    stay out."""
    import multiprocessing as mp
    import time

    from fastmq.listing import format_text, list_queues

    ctx = mp.get_context("spawn")
    w_conn, w_child = ctx.Pipe()
    procs = [ctx.Process(target=writer_main, args=(w_child, 3, 3), daemon=True)]
    procs[0].start()
    try:
        handle = w_conn.recv()
        conns = []
        for rank, k in enumerate([3, 1, 0]):
            a, b = ctx.Pipe()
            procs.append(ctx.Process(target=reader_main, args=(b, handle, rank, k),
                                     daemon=True))
            procs[-1].start()
            conns.append(a)
        assert w_conn.recv() == "sent"
        for c in conns:
            c.recv()
        conns[0].send("park")
        ring = handle.buffer_handle[3].split(":")[0]     # the locator, less ":fd:inode"

        def ours():
            return [q for q in list_queues()["queues"] if q["name"] == ring][0]

        deadline = time.monotonic() + 30
        while ours()["parked_readers"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        procs[3].kill()
        procs[3].join(10)
        listing = list_queues()
        q = ours()
        listing.update(queues=[q], arenas=[], other=[])
        listing["memory"]["fastmq_held_bytes"] = q["held_bytes"] + q["arena"]["held_bytes"]
        return format_text(listing)
    finally:
        w_conn.send("exit")
        procs[0].join(30)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


if __name__ == "__main__":
    print("$ fastmq ls")
    print(demo())
