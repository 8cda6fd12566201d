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
    # Mapped only if the address space allows it; either way refused, by
    # the mapping or by the header's geometry.
    assert ("cannot map its 1 PiB" in other[data]["error"]
            or "bad geometry" in other[data]["error"]), other[data]
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
