"""``fastmq cleanup``: removes exactly what dead fastmq processes left."""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import fastmq
from fastmq import MessageQueue, _proc
from fastmq._ring_writer import RingWriter
from fastmq._segment import Segment

import _fault_children as children

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP = tempfile.gettempdir()
cleanup_module = sys.modules["fastmq.cleanup"]


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _pid_of(path: str) -> int:
    return int(os.path.basename(path).split("_")[1])


def _queue_files(handle) -> set[str]:
    files = {f"/dev/shm/{handle.buffer_handle[3]}"}
    if handle.tensor_arena_handle is not None:
        files.add(f"/dev/shm/{handle.tensor_arena_handle[3]}")
    for addr in (handle.local_subscribe_addr, handle.local_notify_addr):
        if addr:
            files.add(addr[len("ipc://"):])
    return files


def _cli(*args) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "fastmq.cli", "cleanup", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert "file(s) of dead processes" in out.stderr
    return out.stdout.split()


def _round_trip(writer, reader, value):
    writer.enqueue(value)
    assert reader.dequeue(timeout=10) == value


def test_cleanup_after_killed_run_removes_exactly_the_dead_queue(procs, spawn_ctx):
    # A live queue of this process, which must survive every cleanup.
    live = MessageQueue(1, 1, wait_mode="zmq")
    live_reader = MessageQueue.create_from_handle(live.export_handle(), 0)
    live.wait_until_ready()
    live_reader.wait_until_ready()
    live_files = _queue_files(live.handle)

    parent, child = spawn_ctx.Pipe()
    p = procs.start(children.queue_owner, child, "zmq")
    dead_files = _queue_files(parent.recv())
    assert len(dead_files) >= 3 and all(os.path.exists(f) for f in dead_files)
    p.kill()
    p.join(10)
    assert all(os.path.exists(f) for f in dead_files)   # SIGKILL: nothing removed them

    # Dry run lists them and removes nothing.
    listed = set(_cli("--dry-run"))
    assert dead_files <= listed
    assert all(os.path.exists(f) for f in dead_files)

    removed = set(_cli())
    # Exactly the dead queue's files among the dead pid's; nothing of a
    # live process (other dead leftovers on this host may go too).
    assert {f for f in removed if _pid_of(f) == p.pid} == dead_files
    assert not any(_proc.is_alive(_pid_of(f)) for f in removed)
    assert not any(os.path.exists(f) for f in dead_files)
    assert all(os.path.exists(f) for f in live_files)

    # A queue created after the crash works (had cleanup not run, creating
    # it would have removed the dead queue's files: test_lifecycle).
    after = MessageQueue(1, 1, wait_mode="zmq")
    after_reader = MessageQueue.create_from_handle(after.export_handle(), 0)
    after.wait_until_ready()
    after_reader.wait_until_ready()
    _round_trip(after, after_reader, {"after": "crash"})
    assert all(os.path.exists(f) for f in live_files)
    _round_trip(live, live_reader, "still alive")
    _round_trip(after, after_reader, "me too")
    assert p.pid not in {_pid_of(f) for f in fastmq.cleanup(dry_run=True)}


def test_ring_header_identity_matches_creator():
    writer = MessageQueue(1, 1)
    path = f"/dev/shm/{writer.handle.buffer_handle[3]}"
    assert cleanup_module.ring_creator(path) == _proc.me()


def _fake_segment(pid: int, kind: str, header_identity=None) -> Segment:
    seg = Segment.create(f"fastmq_{pid}_{kind}_{secrets.token_hex(6)}", 1 << 16)
    if header_identity is not None:
        RingWriter.create(seg, 1, 4096, 2, 1, 0, *header_identity)
    return seg


def test_ring_header_start_time_defeats_pid_reuse():
    """A ring whose header names a live pid with another start time belongs
    to a dead process whose pid was reused: removed.  The same pid with the
    right start time is live: kept."""
    me, started = _proc.me()
    reused = _fake_segment(me, "ring", (me, started + 12345))
    live = _fake_segment(me, "ring", (me, started))
    try:
        removed = fastmq.cleanup()
        assert f"/dev/shm/{reused.name}" in removed
        assert f"/dev/shm/{live.name}" not in removed
        assert not os.path.exists(f"/dev/shm/{reused.name}")
        assert os.path.exists(f"/dev/shm/{live.name}")
    finally:
        for seg in (reused, live):
            seg.unlink()
            seg.close()


def test_headerless_files_fall_back_to_pid_liveness():
    dead = _dead_pid()
    gone = _fake_segment(dead, "arena")              # no ring header
    kept = _fake_segment(os.getpid(), "arena")
    half = _fake_segment(dead, "ring")               # ring never initialised
    ipc_dead = os.path.join(TMP, f"fastmq_{dead}_{secrets.token_hex(6)}.ipc")
    ipc_live = os.path.join(TMP, f"fastmq_{os.getpid()}_{secrets.token_hex(6)}.ipc")
    bind_dir = tempfile.mkdtemp(prefix=f"fastmq_{dead}_", suffix=".bind")
    for f in (ipc_dead, ipc_live, os.path.join(bind_dir, "s")):
        # A socket file nobody listens on, as a killed process leaves it.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(f)
    try:
        removed = set(fastmq.cleanup())
        assert {f"/dev/shm/{gone.name}", f"/dev/shm/{half.name}", ipc_dead, bind_dir} <= removed
        assert f"/dev/shm/{kept.name}" not in removed and ipc_live not in removed
        assert os.path.exists(ipc_live) and os.path.exists(f"/dev/shm/{kept.name}")
        assert not os.path.exists(bind_dir)
    finally:
        for seg in (gone, kept, half):
            seg.unlink()
            seg.close()
        for f in (ipc_dead, ipc_live):
            if os.path.exists(f):
                os.unlink(f)
        shutil.rmtree(bind_dir, ignore_errors=True)


def test_planted_files_of_the_wrong_type_are_left_alone():
    """A symlink or FIFO under our prefix (world-writable directories) is
    never followed, opened blocking, or removed."""
    dead = _dead_pid()
    link = os.path.join(TMP, f"fastmq_{dead}_{secrets.token_hex(6)}.ipc")
    target = os.path.join(TMP, f"victim_{secrets.token_hex(6)}")
    open(target, "w").close()
    os.symlink(target, link)
    fifo = f"/dev/shm/fastmq_{dead}_ring_{secrets.token_hex(6)}"
    os.mkfifo(fifo)
    try:
        removed = fastmq.cleanup()          # must not hang on the FIFO
        assert link not in removed and fifo not in removed
        assert os.path.exists(target) and os.path.lexists(link) and os.path.exists(fifo)
    finally:
        for f in (link, target, fifo):
            if os.path.lexists(f):
                os.unlink(f)


def test_ipc_socket_still_listening_is_kept():
    """An ipc file whose pid looks dead (a creator in another pid namespace)
    is kept while something accepts connections on it."""
    path = os.path.join(TMP, f"fastmq_{_dead_pid()}_{secrets.token_hex(6)}.ipc")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    try:
        assert path not in fastmq.cleanup()
        assert os.path.exists(path)
    finally:
        srv.close()
    assert path in fastmq.cleanup()          # nobody listens any more
    assert not os.path.exists(path)


@contextlib.contextmanager
def _child(code: str):
    """A Python child running ``code`` (which prints the files it made, one
    line), and those files; killed, reaped and its files removed after."""
    p = subprocess.Popen([sys.executable, "-c", code, TMP], stdout=subprocess.PIPE, text=True)
    files = []
    try:
        files = p.stdout.readline().split()
        yield p, files
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        for f in files:
            if os.path.exists(f):
                os.unlink(f)


_MAKE_FILES = (
    "import os, secrets, socket, sys\n"
    "ipc = os.path.join(sys.argv[1], f'fastmq_{os.getpid()}_{secrets.token_hex(6)}.ipc')\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
    "s.bind(ipc)\n"
    "s.listen(1)\n"
    "seg = f'/dev/shm/fastmq_{os.getpid()}_arena_{secrets.token_hex(6)}'\n"
    "open(seg, 'wb').close()\n"
    "print(ipc, seg, flush=True)\n")


def _state(pid: int, tid: int | None = None) -> str:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_for(predicate, what: str) -> None:
    for _ in range(200):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_files_of_an_exited_process_not_yet_reaped_are_removed():
    """A process that exited but that its parent has not reaped (a zombie:
    its pid still answers signals) owns nothing any more, as with a vLLM
    engine core killed while its parent is gone or busy: its files go."""
    with _child(_MAKE_FILES) as (p, files):
        assert len(files) == 2 and all(os.path.exists(f) for f in files)
        _wait_for(lambda: _state(p.pid) == "Z", "the child to exit")   # not waited for
        assert not _proc.is_alive(p.pid)
        removed = set(fastmq.cleanup())
        assert set(files) <= removed
        assert not any(os.path.exists(f) for f in files)


def test_a_process_whose_main_thread_exited_is_alive_while_a_thread_runs():
    """The main thread's exit leaves the process's first task a zombie while
    its other threads run on: that process is alive, and its files stay."""
    with _child(_MAKE_FILES + (
            "import ctypes, threading, time\n"
            "threading.Thread(target=time.sleep, args=(120,)).start()\n"
            "ctypes.CDLL(None).pthread_exit(None)\n")) as (p, files):
        _wait_for(lambda: _state(p.pid) == "Z", "the main thread to exit")
        assert any(_state(p.pid, int(t)) != "Z" for t in os.listdir(f"/proc/{p.pid}/task"))
        assert _proc.is_alive(p.pid)
        assert _proc.is_alive(p.pid, _proc.start_time(p.pid))
        removed = set(fastmq.cleanup())
        assert not set(files) & removed
        assert all(os.path.exists(f) for f in files)


def test_cli_main_in_process(capsys):
    from fastmq.cli import main

    dead = _dead_pid()
    seg = _fake_segment(dead, "ring")
    try:
        assert main(["cleanup", "--dry-run"]) == 0
        assert f"/dev/shm/{seg.name}" in capsys.readouterr().out.split()
        assert os.path.exists(f"/dev/shm/{seg.name}")
        assert main(["cleanup"]) == 0
        assert f"/dev/shm/{seg.name}" in capsys.readouterr().out.split()
        assert not os.path.exists(f"/dev/shm/{seg.name}")
    finally:
        seg.unlink()
        seg.close()
    with pytest.raises(SystemExit):
        main([])
