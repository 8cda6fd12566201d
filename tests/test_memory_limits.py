"""The memory a queue may take, as the kernel would hand it over, in
containers: page cache the kernel reclaims is room, a limit on an ancestor
or behind a container's cgroup layout is seen, and a message's first write
into a chunk does not read /proc.

Real cgroup v1 memory cgroups (made under this process's own) and real
mount and cgroup namespaces (``unshare``), next to vLLM 0.33.0's own queue
in the same state; cgroup v2, which cannot run here next to v1's memory
controller, on directory trees of real files laid out as the kernel lays
out ``/proc`` and a cgroup2 mount.  Helpers and children:
tests/_memory_children.py.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest

import _memory_children as kids
from fastmq._memory import memory_available, memory_report, parse_mountinfo

MiB = 1 << 20
GiB = 1 << 30


def _need_root_cgroups() -> str:
    own = kids.own_memory_cgroup()
    if own is None:
        pytest.skip("needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory "
                    "(cgroup v2 is tested on constructed trees below)")
    return own


def _need_unshare(*flags: str) -> None:
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", *flags, "true"], capture_output=True).returncode != 0:
        pytest.skip(f"unshare {' '.join(flags)} is not permitted here (needs root)")


@pytest.fixture
def cgroups():
    """Make cgroups under this process's memory cgroup; all removed after
    the test (what runs in them killed first), pass or fail."""
    own = _need_root_cgroups()
    made: list[kids.Cgroup] = []

    def make(limit: int | None = None) -> kids.Cgroup:
        cg = kids.Cgroup(own, f"fastmq_mem_{os.getpid()}_{len(made)}", limit)
        made.append(cg)
        return cg

    try:
        yield make
    finally:
        for cg in reversed(made):
            cg.close()


# -- 1. page cache is room --------------------------------------------------------
CACHE_LIMIT = 640 * MiB            # vLLM's class with torch imported fits in it


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """A file twice the limit (sparse: reading it fills the page cache all
    the same, clean pages the kernel reclaims at once)."""
    path = tmp_path_factory.mktemp("cache") / "big"
    with open(path, "wb") as f:
        f.truncate(2 * CACHE_LIMIT)
    yield str(path)
    os.unlink(path)


@pytest.mark.parametrize("impl", ["fastmq", "vllm"])
def test_page_cache_the_kernel_reclaims_is_room(cgroups, big_file, impl):
    """A cgroup that read more file data than its limit is full of page
    cache: usage is at the limit, yet the kernel hands a new page over at
    once (vLLM's queue takes 9 x 20 MiB there).  fastmq saw 1 MiB free and
    refused both a new queue and a 3 MiB message into a fresh chunk."""
    cg = cgroups(CACHE_LIMIT)
    rc, out, res = kids.run_child(cg, ["cache", impl, big_file], impl)
    assert rc == 0 and res is not None, out[-4000:]
    # The state is real: the cgroup is full, of page cache.
    assert res["after_read"]["usage"] > CACHE_LIMIT - 48 * MiB, res
    assert res["earlier_3mib"] is True, res
    assert res["new_queue"] is True, res
    assert res["messages_20mib"] == 9, res
    if impl == "fastmq":
        assert res["after_read"]["available"] > CACHE_LIMIT // 2, res
        # Shared memory (the ring's own pages) is page cache the kernel
        # cannot reclaim: 128 MiB of it is 128 MiB less room.
        shm = res["shm_128mib"]
        assert shm["after"]["available"] <= shm["before"]["available"] - 120 * MiB, shm
        assert cg.oom_kills() == 0


# -- 2. limits behind the cgroup layout ----------------------------------------------
FILL_LIMIT = 512 * MiB             # the ring kids.fill makes is 640 MiB

LAYOUTS = {
    # A limit on the parent; the process's own cgroup has none.
    "parent": ("plain", True),
    # Docker / Kubernetes v1 without a cgroup namespace: the container's
    # cgroup bind-mounted at /sys/fs/cgroup/memory, /proc/self/cgroup
    # naming the host's path.
    "bind": ("bind", False),
    # Docker's v1 layout with a cgroup namespace, the limit on the parent
    # (a Kubernetes pod's): /proc/self/cgroup says "/", the parent is not
    # visible at all.
    "cgroupns": ("cgroupns", True),
}


def _layout(cgroups, name):
    layout, limit_on_parent = LAYOUTS[name]
    _need_unshare(*{"plain": [], "bind": ["-m"], "cgroupns": ["-C", "-m"]}[layout])
    if limit_on_parent:
        parent = cgroups(FILL_LIMIT)
        return parent, parent.child("inner"), layout
    cg = cgroups(FILL_LIMIT)
    return cg, cg, layout


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_limit_the_old_check_could_not_see_is_a_clear_error_not_an_oom_kill(cgroups, name):
    """The ring is larger than the limit that applies: fastmq refuses it at
    creation with ShmFullError.  It used to read the host's memory there,
    create the ring, and be OOM-killed filling it."""
    limited, run_in, layout = _layout(cgroups, name)
    rc, out, res = kids.run_child(run_in, ["fill", "fastmq"], "fastmq", layout,
                                  FASTMQ_PARTS="0")
    assert rc == 0 and res is not None, (rc, out[-4000:])
    assert res["refused"] and res["refused"].startswith("ShmFullError: "), res
    assert "640.0 MiB" in res["refused"] and "cannot give now" in res["refused"], res
    assert 0 <= res["available"] < FILL_LIMIT, res
    assert limited.oom_kills() + run_in.oom_kills() == 0


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_vllms_queue_in_the_same_layout_is_oom_killed_filling_the_ring(cgroups, name):
    """The other side of the test above: the limit is real in that
    layout, and vLLM's queue, which never asks, ends in the OOM killer."""
    limited, run_in, layout = _layout(cgroups, name)
    rc, out, res = kids.run_child(run_in, ["fill", "vllm"], "vllm", layout)
    assert "CREATED" in out.splitlines(), out[-4000:]
    assert rc == -signal.SIGKILL and res is None, (rc, out[-4000:])
    # (v1 counts a kill where the victim was, not where the limit is.)
    assert run_in.oom_kills() >= 1


def test_no_cgroup_file_system_visible_is_logged_once_and_never_refuses(cgroups):
    """Where no cgroup file system is mounted, the check says once what it
    cannot read and uses the host's MemAvailable only: the queues work as
    vLLM's would."""
    _need_unshare("-m")
    cg = cgroups(FILL_LIMIT)
    rc, out, res = kids.run_child(cg, ["hidden"], "fastmq", "hidden")
    assert rc == 0 and res is not None, out[-4000:]
    assert res["delivered"] is True and res["cgroup"] == [], res
    assert res["available"] == res["host"] > 0, res
    lines = out.splitlines()
    # Logged by the queues' own checks, once for all of them.
    warnings = [ln for ln in lines[:lines.index("QUEUES DONE")]
                if ln.startswith("LOG fastmq WARNING")]
    assert len(warnings) == 1, out[-4000:]
    assert "cannot read this process's memory cgroup" in warnings[0], warnings
    assert "no mount of the cgroup v1 memory controller shows it" in warnings[0], warnings
    assert "uses the host's MemAvailable only" in warnings[0], warnings


# -- 3. no /proc on a message's path --------------------------------------------------
def test_first_write_into_each_chunk_reads_no_proc_or_cgroup_file():
    """The first message into each chunk of a fresh queue used to read
    /proc/meminfo, /proc/self/cgroup and the cgroup's files (several
    hundred microseconds, the first 10 messages of every queue); small ones
    are asked for by the ring's creation now, larger ones answered from the
    reading kept in the background.  Opens counted by an audit hook in a
    child; a large first write near a memory limit (which reads afresh)
    shows that the hook sees them."""
    res = subprocess.run([sys.executable, kids.__file__, "first-writes"],
                         env=kids.child_env("fastmq"), capture_output=True, text=True,
                         timeout=120)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    import json

    got = json.loads(lines[-1][7:])
    assert got["small"] == {n: [] for n in got["small"]}, got["small"]
    assert "/proc/meminfo" in got["large"], got


# -- cgroup v2, on constructed trees --------------------------------------------------
def _tree(root, cgroup: str, mounts: list[tuple[str, str, str]], files: dict[str, str],
          meminfo_kb: int | None = 8 * GiB // 1024):
    """A root with proc/self/cgroup (``cgroup``), proc/self/mountinfo (each
    mount (fstype, cgroup root, mount point)), proc/meminfo, and ``files``
    (path below ``root`` -> contents)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    lines = ["22 27 0:21 / /proc rw,relatime - proc proc rw",
             "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw"]
    for i, (fstype, croot, point) in enumerate(mounts):
        opts = "rw,nsdelegate" if fstype == "cgroup2" else "rw,memory"
        lines.append(f"{40 + i} 23 0:{30 + i} {croot} {point} rw,nosuid shared:9 - "
                     f"{fstype} {fstype if fstype == 'cgroup2' else 'cgroup'} {opts}")
    (root / "proc/self/mountinfo").write_text("\n".join(lines) + "\n")
    if meminfo_kb is not None:
        (root / "proc/meminfo").write_text(
            f"MemTotal:       {2 * meminfo_kb} kB\nMemFree:        1000 kB\n"
            f"MemAvailable:   {meminfo_kb} kB\n")
    for path, text in files.items():
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


def _v2(max_: int | str, current: int, file=0, shmem=0, active_file=0, inactive_file=0,
        dirty=0, writeback=0) -> dict[str, str]:
    stat = (f"anon {current - file}\nfile {file}\nkernel 0\nshmem {shmem}\n"
            f"file_mapped 0\nfile_dirty {dirty}\nfile_writeback {writeback}\n"
            f"inactive_anon 0\nactive_anon 0\ninactive_file {inactive_file}\n"
            f"active_file {active_file}\nunevictable 0\n")
    return {"memory.max": f"{max_}\n", "memory.current": f"{current}\n",
            "memory.stat": stat, "memory.high": "max\n", "cgroup.controllers": "memory pids\n"}


def _files(base: str, **levels: dict[str, str]) -> dict[str, str]:
    return {f"{base}/{d}/{name}".replace("//", "/"): text
            for d, files in levels.items() for name, text in files.items()}


def test_v2_room_counts_clean_page_cache_but_not_shared_memory(tmp_path):
    # 10 MiB below the limit; 600 MiB of "file", 200 of it shared memory
    # (memfd pages count there), 350 MiB on the file LRUs, 30 dirty or
    # under writeback: 320 MiB the kernel would reclaim.
    ctr = _v2(GiB, GiB - 10 * MiB, file=600 * MiB, shmem=200 * MiB,
              active_file=250 * MiB, inactive_file=100 * MiB, dirty=20 * MiB,
              writeback=10 * MiB)
    root = _tree(tmp_path, "0::/docker/abc\n", [("cgroup2", "/", "/sys/fs/cgroup")],
                 _files("sys/fs/cgroup", **{"docker/abc": ctr, "docker": {}}))
    rep = memory_report(root)
    assert rep["cgroup"][0]["reclaimable"] == 320 * MiB, rep
    assert memory_available(root) == 330 * MiB


def test_v2_the_tightest_ancestor_wins(tmp_path):
    # Kubernetes, cgroup v2, no cgroup namespace: the pod's limit (on the
    # container's parent) has 50 MiB left, the container's own 300 MiB.
    pod = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice"
    ctr = f"{pod}/cri-containerd-abc.scope"
    files = _files("sys/fs/cgroup", **{
        ctr: _v2(GiB, GiB - 300 * MiB),
        pod: _v2(2 * GiB, 2 * GiB - 50 * MiB),
        "kubepods.slice/kubepods-burstable.slice": _v2("max", 5 * GiB),
        "kubepods.slice": _v2(20 * GiB, 5 * GiB)})
    root = _tree(tmp_path, f"0::/{ctr}\n", [("cgroup2", "/", "/sys/fs/cgroup")], files)
    rep = memory_report(root)
    assert [lv["room"] for lv in rep["cgroup"]] == [300 * MiB, 50 * MiB, 15 * GiB], rep
    assert memory_available(root) == 50 * MiB


def test_v2_cgroup_namespace_and_bind_mount_layouts(tmp_path):
    # With a cgroup namespace /proc/self/cgroup says "/" and the mount
    # shows the container's cgroup at /sys/fs/cgroup.
    ns = _tree(tmp_path / "ns", "0::/\n", [("cgroup2", "/", "/sys/fs/cgroup")],
               _files("sys/fs/cgroup", **{"": _v2(512 * MiB, 500 * MiB)}))
    assert memory_available(ns) == 12 * MiB
    # Without one, the container's cgroup bind-mounted there: the mount's
    # root names it, /proc/self/cgroup the host's whole path.
    bind = _tree(tmp_path / "bind", "0::/system.slice/docker-abc.scope\n",
                 [("cgroup2", "/system.slice/docker-abc.scope", "/sys/fs/cgroup")],
                 _files("sys/fs/cgroup", **{"": _v2(512 * MiB, 480 * MiB)}))
    assert memory_available(bind) == 32 * MiB
    # "max" is no limit: the host's MemAvailable.
    nolimit = _tree(tmp_path / "max", "0::/\n", [("cgroup2", "/", "/sys/fs/cgroup")],
                    _files("sys/fs/cgroup", **{"": _v2("max", 500 * MiB)}))
    assert memory_available(nolimit) == 8 * GiB


def test_v1_tree_a_limit_above_the_namespace_root(tmp_path):
    # Docker v1 with a cgroup namespace: only the container's cgroup is
    # visible; the kernel's hierarchical_memory_limit names the pod's.
    stat = ("cache 104857600\nshmem 0\ntotal_cache 104857600\ntotal_shmem 0\n"
            "total_inactive_file 62914560\ntotal_active_file 41943040\ntotal_dirty 0\n"
            "total_writeback 0\nhierarchical_memory_limit 419430400\n")
    root = _tree(tmp_path, "4:memory:/\n0::/\n",
                 [("cgroup", "/", "/sys/fs/cgroup/memory")],
                 {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
                  "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{400 * MiB}\n",
                  "sys/fs/cgroup/memory/memory.stat": stat})
    # 400 MiB limit, 400 MiB used, 100 MiB of it clean page cache.
    assert memory_available(root) == 100 * MiB


def test_unreadable_limits_are_logged_once_and_fall_back(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="fastmq")
    # A memory.max that cannot be read (a directory where the file should be).
    files = _files("sys/fs/cgroup", **{"c": _v2(GiB, GiB - MiB)})
    del files["sys/fs/cgroup/c/memory.max"]
    root = _tree(tmp_path / "a", "0::/c\n", [("cgroup2", "/", "/sys/fs/cgroup")], files)
    os.mkdir(os.path.join(root, "sys/fs/cgroup/c/memory.max"))
    assert memory_available(root) == 8 * GiB
    assert memory_available(root) == 8 * GiB
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert "sys/fs/cgroup/c/memory.max" in msgs[0] and "Is a directory" in msgs[0], msgs
    assert "uses the host's MemAvailable only" in msgs[0], msgs
    caplog.clear()
    # Neither a cgroup mount nor /proc/meminfo: no check at all.
    bare = _tree(tmp_path / "b", "0::/c\n", [], {}, meminfo_kb=None)
    assert memory_available(bare) == -1
    msgs = [r.getMessage() for r in caplog.records]
    assert any("no mount of the cgroup v2 file system shows it" in m for m in msgs), msgs
    assert all("uses nothing: it refuses no allocation" in m for m in msgs), msgs


def test_mountinfo_escapes_and_mounts_over_mounts():
    text = (b"35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            b"36 31 0:33 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
            b"50 35 0:32 /docker/a\\040b /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            b"51 31 0:40 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
            b"52 31 0:41 / /sys/fs/cgroup/unified rw - tmpfs tmpfs rw\n")
    assert parse_mountinfo(text) == [(1, "/docker/a b", "/sys/fs/cgroup/memory")]
