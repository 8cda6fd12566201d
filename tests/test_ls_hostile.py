"""``fastmq ls`` against memory files of another user named like fastmq's
segments: huge and sparse, sealed or not, with a forged header, or cut
under it by their holder.  Each is listed with the reason it is not read;
the caller's own queue is listed as ever; ``ls`` exits 0 and never takes a
SIGBUS (fastmq/listing.py, ``_unmappable``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _ls_children as kids
from fastmq import MessageQueue, _arena, _ring

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="a process of another uid (setuid to 65534) needs root")


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "fastmq.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.fixture
def own_queue():
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2, enable_shm_tensor_arena=False)
    try:
        yield mq.export_handle().buffer_handle[3].split(":")[0]
    finally:
        mq.shutdown()
        del mq


@pytest.fixture
def foreign():
    held = []

    def start(specs):
        f = kids.Foreign(specs)
        held.append(f)
        return f

    try:
        yield start
    finally:
        for f in held:
            f.stop()


def test_huge_foreign_memfds_are_named_with_the_reason_and_hide_nothing(own_queue, foreign):
    """Before, root's ``fastmq ls`` mapped a 1 PiB file of another user whole:
    ``OSError: [Errno 12]``, exit 1, nothing listed."""
    f = foreign([("sparse", "ring"), ("sparse", "arena"), ("sealed", "ring"),
                 ("sealed", "arena"),
                 # A header that claims the flags run for a PiB, and one whose
                 # flags are small but whose data (the whole PiB) is mapped
                 # only if the address space allows.
                 ("forged", "ring", _ring.MAGIC, kids.PiB),
                 ("forged", "arena", _arena.MAGIC, 4096),
                 ("forged", "ring", _arena.MAGIC, 4096)])
    out = _cli("ls", "--json")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    assert [q["name"] for q in listing["queues"]].count(own_queue) == 1
    other = {o["name"]: o for o in listing["other"]}
    assert set(f.names) <= set(other), (f.names, sorted(other))
    for name in f.names:
        o = other[name]
        assert (o["uid"], o["held_by"], o["segment_bytes"]) == (kids.NOBODY, [f.pid], kids.PiB)
        assert o["error"], o
    sparse_ring, sparse_arena, sealed_ring, sealed_arena, flags, data, wrong = f.names
    for name in (sparse_ring, sparse_arena):
        assert other[name]["error"].startswith(
            "not sealed against shrinking and growing, as fastmq seals its segments: "
            "not mapped"), other[name]
    assert other[sealed_ring]["error"] == "not a fastmq ring (no fastmq header)"
    assert other[sealed_arena]["error"] == "not a fastmq arena (no fastmq header)"
    assert other[flags]["error"].startswith(
        f"its fastmq ring header puts the data at byte {kids.PiB}: a header and flags "
        "larger than ls reads"), other[flags]
    # Its header and flags are mapped (a few pages, not its 1 PiB), and the
    # forged header is refused for what it says.
    assert other[data]["error"] == ("fastmq arena layout version 0, this fastmq reads "
                                    f"version {_arena.LAYOUT_VERSION}"), other[data]
    assert other[wrong]["error"] == "not a fastmq ring (no fastmq header)"

    text = _cli("ls")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert any(ln.startswith(f"{own_queue}  writer {os.getpid()} ") for ln in lines), text.stdout
    for name in f.names:
        line = next(ln for ln in lines if ln.startswith(name))
        assert line.startswith(f"{name}  unreadable: "), line
        assert line.endswith(f" (owner uid {kids.NOBODY}, held by pid {f.pid}); 1 PiB"), line


_LIST_MANY = """\
import json, sys
from fastmq.listing import list_queues
for _ in range(int(sys.argv[1])):
    listing = list_queues()
print(json.dumps(listing))
"""


def test_a_memfd_cut_under_ls_by_its_holder_is_never_mapped(own_queue, foreign):
    """Before, ``ls`` mapped a file whose holder cuts it to 0 bytes and grows
    it again in a loop, and died when the cut came between its ``fstat``
    and its mapping (``ValueError: mmap length is greater than file size``)
    or its read (SIGBUS)."""
    f = foreign([("truncating", "ring")])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _LIST_MANY, "150"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-4000:])
    listing = json.loads(out.stdout)
    assert [q["name"] for q in listing["queues"]].count(own_queue) == 1
    (cut,) = [o for o in listing["other"] if o["name"] == f.names[0]]
    # Seen empty (0 bytes) or not sealed: never mapped either way.
    assert cut["error"] in ("empty segment", ) or cut["error"].startswith(
        "not sealed against shrinking and growing"), cut
    assert (cut["uid"], cut["held_by"]) == (kids.NOBODY, [f.pid])


def test_ls_maps_only_a_segments_header_and_flags():
    """``ls`` reads a ring's and an arena's header and flags only, and maps
    no more than that (it used to map every segment whole: 1 PiB of
    address space for a sparse one, and a real ring's chunks)."""
    mq = MessageQueue(1, 1, max_chunk_bytes=4 << 20, max_chunks=4,
                      arena_slots=2, arena_slot_mb=16, arena_min_mb=1)
    ring = mq.export_handle().buffer_handle[3].split(":")[0]
    arena = mq.export_handle().tensor_arena_handle[3].split(":")[0]
    code = ("import json, sys\n"
            "maps = []\n"
            "sys.addaudithook(lambda e, a: maps.append(a[1]) if e == 'mmap.__new__' else None)\n"
            "from fastmq import listing\n"
            "out = listing.list_queues()\n"
            "print(json.dumps({'maps': maps, 'listing': out}))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=env)
        assert got.returncode == 0, got.stderr
        result = json.loads(got.stdout)
        (q,) = [q for q in result["listing"]["queues"] if q["name"] == ring]
        assert q["arena"] and q["arena"]["name"] == arena, q
        assert result["maps"], "ls mapped nothing"
        # A ring's header and flags take a few pages, an arena's up to where
        # its slots start (2 MiB aligned); the ring is 16 MiB, the arena 32.
        assert max(result["maps"]) <= 2 << 20, result["maps"]
    finally:
        mq.shutdown()
        del mq
