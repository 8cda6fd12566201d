"""``fastmq ls``: what it reports about live queues, and that looking never
changes a segment."""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import _ls_children as kids
from _queues import wait_for
from fastmq.cli import cleanup_hint, main as cli_main
from fastmq.listing import format_text, list_queues, positions

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "fastmq.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env, **kw)


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _queue(listing: dict, ring: str) -> dict:
    found = [q for q in listing["queues"] if q["name"] == ring]
    assert len(found) == 1, f"{ring} not listed once: {[q['name'] for q in listing['queues']]}"
    return found[0]


def _block(text: str, ring: str) -> list[str]:
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(ring))
    j = next((j for j in range(i, len(lines)) if not lines[j].strip()), len(lines))
    return lines[i:j]


def _row(block: list[str], rank: int) -> list[str]:
    rows = [ln.split() for ln in block if re.match(rf"^  {rank}\s", ln)]
    assert len(rows) == 1, block
    return rows[0]


def _remove_files_of(pid: int) -> None:
    for p in glob.glob(f"/dev/shm/fastmq_{pid}_*") + glob.glob(
            os.path.join(tempfile.gettempdir(), f"fastmq_{pid}_*.ipc")):
        try:
            os.unlink(p)
        except OSError:
            pass


def _documented_ls_block() -> list[str]:
    doc = (ROOT / "docs" / "operations.md").read_text()
    i = doc.index("## Inspecting: `fastmq ls`")
    start = doc.index("```\n$ fastmq ls\n", i) + len("```\n$ fastmq ls\n")
    return doc[start:doc.index("\n\n", start)].splitlines()


def _shape(lines: list[str]) -> list[list[str]]:
    """Tokens with numbers and segment names blanked (pids, sizes differ)."""
    return [re.sub(r"\d+(\.\d+)?", "N", re.sub(r"fastmq_\d+_(\w+?)_[0-9a-f]+", r"fastmq_\1", ln)
                   ).split() for ln in lines]


# -- positions from the counters ------------------------------------------------

def test_positions_from_the_counters():
    # 9 messages published into a 4-chunk ring; readers read 9, 7 and 5.
    assert positions(9, [9, 7, 5], 4) == (1, [{"chunk": 1, "behind": 0},
                                               {"chunk": 3, "behind": 2},
                                               {"chunk": 1, "behind": 4}])
    assert positions(0, [0], 3) == (0, [{"chunk": 0, "behind": 0}])


# -- live queues ---------------------------------------------------------------

def test_ls_live_queue_positions_parked_dead_reader_and_dead_writer(procs, spawn_ctx):
    """A writer that sent 3 messages (the third with an array in an arena
    slot) to 3 readers that read 3, 1 and 0 of them; then reader 0 parks,
    reader 2 is killed, and finally the writer is killed."""
    w_conn, w_child = spawn_ctx.Pipe()
    writer = procs.start(kids.writer_main, w_child, 3, 3)
    handle = w_conn.recv()
    ring = handle.buffer_handle[3]
    arena = handle.tensor_arena_handle[3]
    readers, conns = [], []
    for rank, k in enumerate([3, 1, 0]):
        a, b = spawn_ctx.Pipe()
        readers.append(procs.start(kids.reader_main, b, handle, rank, k))
        conns.append(a)
    try:
        assert w_conn.recv() == "sent"
        for rank, k in enumerate([3, 1, 0]):
            assert conns[rank].recv() == ("read", k)

        # Everything is idle: listing must not change one byte of either segment.
        ring_path, arena_path = f"/dev/shm/{ring}", f"/dev/shm/{arena}"
        with open(ring_path, "rb") as f:
            ring_before = f.read()
        with open(arena_path, "rb") as f:
            arena_before = f.read(8192)       # header and slot flags
        stat_before = (os.stat(ring_path).st_mtime_ns, os.stat(arena_path).st_mtime_ns)
        out = _cli("ls", "--json")
        assert out.returncode == 0, out.stderr
        with open(ring_path, "rb") as f:
            assert f.read() == ring_before, "fastmq ls changed the ring segment"
        with open(arena_path, "rb") as f:
            assert f.read(8192) == arena_before, "fastmq ls changed the arena segment"
        assert (os.stat(ring_path).st_mtime_ns,
                os.stat(arena_path).st_mtime_ns) == stat_before

        q = _queue(json.loads(out.stdout), ring)
        assert q["writer"] == {"pid": writer.pid, "name": _comm(writer.pid), "alive": True,
                                    "state": "alive", "next_chunk": 3, "parked": False}
        assert (q["n_reader"], q["max_chunks"], q["max_chunk_bytes"], q["wait_mode"]) == (
            3, kids.CHUNKS, kids.CHUNK, "futex")
        assert q["parked_readers"] == 0
        assert [(r["rank"], r["pid"], r["state"], r["chunk"], r["behind"])
                for r in q["readers"]] == [
            (0, readers[0].pid, "alive", 3, 0),
            (1, readers[1].pid, "alive", 1, 2),
            (2, readers[2].pid, "alive", 0, 3)]
        assert q["segment_bytes"] == os.stat(ring_path).st_size
        assert 0 < q["shm_used_bytes"] <= q["segment_bytes"]
        a = q["arena"]
        assert a["name"] == arena and (a["n_slots"], a["slot_bytes"]) == (2, 2 << 20)
        # Reader 0 read the array and dropped it; 1 and 2 have not read it.
        assert [(u["slot"], u["ranks"]) for u in a["slots_in_use"]] == [(0, [1, 2])]
        assert [x["pid"] for x in a["slots_in_use"][0]["readers"]] == [
            readers[1].pid, readers[2].pid]

        # Reader 0 waits for a message that does not come: it parks.
        conns[0].send("park")
        wait_for(lambda: _queue(list_queues(), ring)["parked_readers"] == 1, timeout=30)
        # A parked reader re-checks every park slice and is briefly not
        # counted then: look again if the CLI caught that moment.
        for _ in range(5):
            text = _cli("ls")
            assert text.returncode == 0, text.stderr
            block = _block(text.stdout, ring)
            if "parked readers: 1" in block[2]:
                break
        assert block[0].split() == [ring, "writer", str(writer.pid), f"({_comm(writer.pid)})",
                                    "alive"]
        assert "writer next chunk 3; parked readers: 1" in block[2]
        assert _row(block, 1)[1:] == [str(readers[1].pid), _comm(readers[1].pid), "alive",
                                      "1", "2"]
        assert any(ln.strip().startswith("slot 0: not yet released by rank 1 (pid "
                                         f"{readers[1].pid}), rank 2 (pid {readers[2].pid})")
                   for ln in block), block

        # A dead reader.
        readers[2].kill()
        readers[2].join(10)
        q = _queue(list_queues(), ring)
        r2 = q["readers"][2]
        assert (r2["pid"], r2["state"], r2["alive"], r2["chunk"], r2["behind"]) == (
            readers[2].pid, "dead", False, 0, 3)
        assert q["arena"]["slots_in_use"][0]["readers"][1]["state"] == "dead"
        block = _block(format_text(list_queues()), ring)
        assert _row(block, 2)[1:] == [str(readers[2].pid), "-", "dead", "0", "3"]
        # docs/operations.md shows this very state (tests/_ls_children.py makes it).
        assert _shape(block) == _shape(_documented_ls_block()), (
            "the fastmq ls output in docs/operations.md is stale")

        # A dead writer.  A reader waiting in dequeue() would notice and
        # remove the dead writer's files (as it should); stop the one that
        # waits, so that the dead writer's ring stays for ls to show.
        os.kill(readers[0].pid, signal.SIGSTOP)
        writer.kill()
        writer.join(10)
        q = _queue(list_queues(), ring)
        assert (q["writer"]["pid"], q["writer"]["state"]) == (writer.pid, "dead")
        assert q["readers"][1]["state"] == "alive" and q["readers"][1]["behind"] == 2
        assert _block(format_text(list_queues()), ring)[0].endswith(f"writer {writer.pid} dead")
        # ... and says what removes a dead writer's files.
        out = _cli("ls")
        assert out.returncode == 0, out.stderr
        assert re.search(r"^\d+ queues? ha(s|ve) a dead writer: `fastmq cleanup` removes",
                         out.stdout, re.M), out.stdout
    finally:
        procs.kill_all()
        _remove_files_of(writer.pid)


# `fastmq ls` as a terminal starts it: SIGINT handled by Python and not
# blocked.  A child inherits its parent's ignored signals and signal mask,
# and in the whole suite the watch has been seen to sleep on through SIGINT
# (its cause is not known); what the child inherited is said on stderr.
_AS_AT_A_TERMINAL = """\
import runpy, signal, sys
inherited = (signal.getsignal(signal.SIGINT),
             signal.pthread_sigmask(signal.SIG_BLOCK, []))
if inherited != (signal.default_int_handler, set()):
    print(f"inherited SIGINT handler and blocked signals: {inherited}", file=sys.stderr)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
sys.argv = ["fastmq", *sys.argv[1:]]
runpy.run_module("fastmq.cli", run_name="__main__")
"""


def test_ls_watch_refreshes_until_interrupted():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args, marker in ((["ls", "-w", "0.2"], "Every 0.2s: fastmq ls"),
                         (["ls", "--json", "-w", "0.2"], '"queues": [')):
        p = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", _AS_AT_A_TERMINAL,
                              *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            seen = []
            deadline = time.monotonic() + 60
            while len(seen) < 3 and time.monotonic() < deadline:
                line = p.stdout.readline()
                if marker in line:
                    seen.append(line)
            assert len(seen) == 3, f"{args}: {seen}"
            if "--json" in args:
                assert all(isinstance(json.loads(s)["queues"], list) for s in seen)
            p.send_signal(signal.SIGINT)
            # Read what is left: a listing of many queues can fill the pipe,
            # and the exit flushes stdout.
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGABRT)    # faulthandler prints where it is
                _, err = p.communicate(timeout=30)
                pytest.fail(f"{args}: still running 30 s after SIGINT:\n{err[-8000:]}")
            assert p.returncode == 0, err
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_ls_reports_unreadable_segments(capsys):
    junk = [f"/dev/shm/fastmq_{os.getpid()}_ring_00000000aaaa",
            f"/dev/shm/fastmq_{os.getpid()}_ring_00000000bbbb",
            f"/dev/shm/fastmq_{os.getpid()}_arena_00000000cccc"]
    try:
        for path, data in zip(junk, [b"\0" * 100, b"\x01" * 8192, b"\x02" * 8192]):
            with open(path, "wb") as f:
                f.write(data)
        assert cli_main(["ls", "--json"]) == 0
        other = {o["name"]: o["error"] for o in json.loads(capsys.readouterr().out)["other"]}
        names = [os.path.basename(p) for p in junk]
        assert "too few" in other[names[0]]
        assert "not a fastmq ring" in other[names[1]]
        assert "not a fastmq arena" in other[names[2]]
        assert cli_main(["ls"]) == 0
        assert f"{names[1]}  unreadable: not a fastmq ring" in capsys.readouterr().out
    finally:
        for p in junk:
            os.unlink(p)


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "1e9"])
def test_ls_rejects_bad_intervals(bad, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["ls", "-w", bad])
    assert e.value.code == 2
    assert "argument -w/--watch" in capsys.readouterr().err


def test_ls_hints_at_cleanup_for_a_dead_writer():
    def listing(*states):
        return {"queues": [{"name": f"q{i}", "writer": {"state": s}}
                           for i, s in enumerate(states)]}

    assert cleanup_hint(listing()) is None
    assert cleanup_hint(listing("alive", "alive")) is None
    assert cleanup_hint(listing("alive", "dead")) == (
        "1 queue has a dead writer: `fastmq cleanup` removes its files "
        "(`fastmq cleanup --dry-run` lists them first).")
    assert cleanup_hint(listing("dead", "dead")).startswith(
        "2 queues have a dead writer: `fastmq cleanup` removes their files")
