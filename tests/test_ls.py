"""``fastmq ls``: what it reports about live queues, and that looking never
changes a segment."""
from __future__ import annotations

import fcntl
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _ls_children as kids
from _queues import wait_for
from fastmq import MessageQueue
from fastmq.cli import main as cli_main
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


def _through_creator(locator: str) -> str:
    """The path a reader opens a segment by: its creator's descriptor."""
    name, fd, _ino = locator.rsplit(":", 2)
    return f"/proc/{name.split('_')[1]}/fd/{fd}"


def _contents(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _descriptor_holders(name: str) -> list[int]:
    """Processes holding a descriptor of segment ``name`` (not just a mapping)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.split()[0] == f"/memfd:{name}":
                out.append(int(pid))
                break
    return out


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
    ring_loc, arena_loc = handle.buffer_handle[3], handle.tensor_arena_handle[3]
    ring, arena = ring_loc.split(":")[0], arena_loc.split(":")[0]
    ring_path, arena_path = _through_creator(ring_loc), _through_creator(arena_loc)
    readers, conns = [], []
    for rank, k in enumerate([3, 1, 0]):
        a, b = spawn_ctx.Pipe()
        readers.append(procs.start(kids.reader_main, b, handle, rank, k))
        conns.append(a)
    try:
        assert w_conn.recv() == "sent"
        for rank, k in enumerate([3, 1, 0]):
            assert conns[rank].recv() == ("read", k)

        # Everything is idle: listing must not change one byte of either
        # segment (read through the writer's descriptors, as a reader opens them).
        ring_before, arena_before = _contents(ring_path), _contents(arena_path)
        assert len(ring_before) == os.stat(ring_path).st_size > 0
        out = _cli("ls", "--json")
        assert out.returncode == 0, out.stderr
        assert _contents(ring_path) == ring_before, "fastmq ls changed the ring segment"
        assert _contents(arena_path) == arena_before, "fastmq ls changed the arena segment"

        listing = json.loads(out.stdout)
        q = _queue(listing, ring)
        assert "path" not in q and "shm" not in listing
        assert q["mapped_by"] == sorted([writer.pid] + [r.pid for r in readers])
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
        assert 0 < q["held_bytes"] <= q["segment_bytes"]
        a = q["arena"]
        assert a["name"] == arena and (a["n_slots"], a["slot_bytes"]) == (2, 2 << 20)
        assert a["mapped_by"] == q["mapped_by"]
        assert a["segment_bytes"] == os.stat(arena_path).st_size
        # The array went into a slot: at least its pages are held.
        assert kids.ARRAY_BYTES <= a["held_bytes"] <= a["segment_bytes"]
        assert listing["memory"]["fastmq_held_bytes"] >= q["held_bytes"] + a["held_bytes"]
        assert listing["memory"]["available_bytes"] > 0
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

        # A dead writer whose readers still map its segments.  A reader
        # waiting in dequeue() would notice and exit, unmapping them; stop
        # the one that waits, so that what ls shows stays put.
        os.kill(readers[0].pid, signal.SIGSTOP)
        writer.kill()
        writer.join(10)
        # No process holds a descriptor of the ring any more: ls can only
        # read it through a reader's mapping (/proc/<pid>/map_files).
        assert _descriptor_holders(ring) == []
        out = _cli("ls", "--json")
        assert out.returncode == 0, out.stderr
        listing = json.loads(out.stdout)
        assert ring not in [o["name"] for o in listing["other"]], listing["other"]
        q = _queue(listing, ring)
        assert q["mapped_by"] == sorted([readers[0].pid, readers[1].pid])
        assert (q["writer"]["pid"], q["writer"]["state"], q["writer"]["alive"]) == (
            writer.pid, "dead", False)
        assert q["readers"][1]["state"] == "alive" and q["readers"][1]["behind"] == 2
        assert q["segment_bytes"] == len(ring_before)
        assert 0 < q["held_bytes"] <= q["segment_bytes"]
        assert q["arena"] is not None and q["arena"]["name"] == arena
        assert [(u["slot"], u["ranks"]) for u in q["arena"]["slots_in_use"]] == [(0, [1, 2])]
        out = _cli("ls")
        assert out.returncode == 0, out.stderr
        assert _block(out.stdout, ring)[0].endswith(f"writer {writer.pid} dead")
        # Nothing to clean up: the kernel frees the segments with their last
        # process, so ls points at no cleanup.
        assert "cleanup" not in out.stdout, out.stdout
    finally:
        procs.kill_all()


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


def _memfd(name: str, data: bytes, sealed: bool = True) -> int:
    """A memory file named ``name`` holding ``data``, sealed as fastmq seals
    its segments unless ``sealed`` is false."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0))
    try:
        os.write(fd, data)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, kids.SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def test_ls_reports_unreadable_segments(capsys):
    """Segments named like fastmq's that are not what their name says are
    listed under "other" with the reason, and do not hide the queues."""
    me = os.getpid()
    junk = {f"fastmq_{me}_ring_00000000aaaa": b"\0" * 100,
            f"fastmq_{me}_ring_00000000bbbb": b"\x01" * 8192,
            f"fastmq_{me}_arena_00000000cccc": b"\x02" * 8192,
            f"fastmq_{me}_ring_00000000dddd": b"",
            f"fastmq_{me}_blob_00000000eeee": b"\x03" * 4096,
            # Not sealed: a holder may cut it under a mapping, so ls does not map it.
            f"fastmq_{me}_ring_00000000ffff": b"\x04" * 8192}
    fds = []
    mq = None
    try:
        for name, data in junk.items():
            fds.append(_memfd(name, data, sealed=not name.endswith("ffff")))
        mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2,
                          enable_shm_tensor_arena=False)
        real = mq.export_handle().buffer_handle[3].split(":")[0]
        assert cli_main(["ls", "--json"]) == 0
        listing = json.loads(capsys.readouterr().out)
        other = {o["name"]: o for o in listing["other"]}
        assert set(junk) <= set(other), sorted(other)
        names = list(junk)
        assert "not a fastmq ring (no fastmq header)" in other[names[0]]["error"]
        assert "not a fastmq ring" in other[names[1]]["error"]
        assert "not a fastmq arena" in other[names[2]]["error"]
        assert other[names[3]]["error"] == "empty segment"
        assert other[names[4]]["error"] is None and other[names[4]]["kind"] == "blob"
        assert other[names[5]]["error"].startswith(
            "not sealed against shrinking and growing, as fastmq seals its segments: "
            "not mapped"), other[names[5]]
        for name in names[:3] + names[4:]:
            assert other[name]["segment_bytes"] == len(junk[name])
            assert len(junk[name]) <= other[name]["held_bytes"] <= 8192
            assert other[name]["mapped_by"] == []       # held, not mapped
        # The junk hides neither the real queue next to it nor its own name.
        q = _queue(listing, real)
        assert q["writer"]["pid"] == me and q["readers"][0]["state"] == "not attached"
        assert not set(junk) & {x["name"] for x in listing["queues"] + listing["arenas"]}
        assert listing["memory"]["fastmq_held_bytes"] >= q["held_bytes"] + sum(
            other[name]["held_bytes"] for name in names)
        assert cli_main(["ls"]) == 0
        text = capsys.readouterr().out
        lines = text.splitlines()
        assert any(re.fullmatch(rf"{names[1]}  unreadable: not a fastmq ring.*; 8 KiB", ln)
                   for ln in lines), text
        assert f"{names[4]}  blob segment; 4 KiB" in lines
        assert any(ln.startswith(f"{real}  writer {me} ") for ln in lines), text
    finally:
        for fd in fds:
            os.close(fd)
        del mq
        gc.collect()


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "1e9"])
def test_ls_rejects_bad_intervals(bad, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["ls", "-w", bad])
    assert e.value.code == 2
    assert "argument -w/--watch" in capsys.readouterr().err


def test_ls_never_maps_a_segment_whose_header_is_not_fastmqs():
    """A sealed memory file named like a ring, small enough that ``ls`` used
    to map it whole for the snapshot to name what is wrong, is listed with
    the reason read through ``pread`` and not mapped at all."""
    code = ("import fcntl, json, os, sys\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "import _ls_children as kids\n"
            "name = f'fastmq_{os.getpid()}_ring_00000000abcd'\n"
            "fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)\n"
            "os.write(fd, b'\\x05' * (512 << 10))\n"
            "fcntl.fcntl(fd, fcntl.F_ADD_SEALS, kids.SEALS)\n"
            "maps = []\n"
            "sys.addaudithook(lambda e, a: maps.append(a[1]) if e == 'mmap.__new__' else None)\n"
            "from fastmq import listing\n"
            "out = listing.list_queues()\n"
            "(mine,) = [o for o in out['other'] if o['name'] == name]\n"
            "print(json.dumps({'maps': maps, 'error': mine['error']}))\n")
    got = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests")], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert got.returncode == 0, got.stderr
    result = json.loads(got.stdout)
    assert result["error"] == "not a fastmq ring (no fastmq header)", result
    assert 512 << 10 not in result["maps"], result["maps"]
