"""What a user downloads: the sdist has everything to build and test fastmq,
the wheel built from it has the compiled modules and no build leftovers,
and the sdist's own tests pass against the package installed from it in a
fresh virtual environment.

Built offline with what ``.ci/setup`` installs (setuptools, Cython, pip):
the sdist through setuptools' PEP 517 hook (what ``python -m build
--sdist --no-isolation`` calls), the wheel with ``pip wheel
--no-build-isolation`` from that sdist file, as pip does for a user.
"""
from __future__ import annotations

import email.parser
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIST = "vllm-fastmq"
COMPILED = ["_segment", "_memory", "_sink", "_ring", "_ring_writer", "_ring_reader", "_arena", "_arena_pages",
            "_arena_writer", "_arena_reader", "_floor"]

# What the sdist must carry beyond the package: the test suite with its
# helpers (a missing conftest or children module makes it unrunnable), the
# benchmark results and the docs the README links (the README tests read the
# docs), the CI scripts, the licence.
SDIST_REQUIRED = [
    "LICENSE", "README.md", "docs/design.md", "docs/operations.md",
    "pyproject.toml", "setup.py", "MANIFEST.in",
    ".ci/setup", ".ci/run",
    "bench/RESULTS.md", "bench/run.sh", "bench/results.json",
    "tests/conftest.py", "tests/_queues.py", "tests/_core_children.py",
    "tests/_arena_children.py", "tests/_fault_children.py", "tests/_wakeup_children.py",
    "tests/_vllm_children.py", "tests/_ls_children.py", "tests/gpu/test_arena_cuda.py",
    "tests/test_packaging.py",
    "fastmq/_ring.pyx", "fastmq/_ring.pxd", "fastmq/_ring_layout.pxd",
    "fastmq/_ring_writer.pyx", "fastmq/_ring_writer.pxd",
    "fastmq/_ring_reader.pyx", "fastmq/_ring_reader.pxd",
    "fastmq/_native/fmq_atomic.h", "fastmq/_native/fmq_populate.h", "fastmq/_native/fmq_copy.h",
    "fastmq/_native/fmq_cow.h", "fastmq/_native/fmq_stream_copy.h", "fastmq/_native/layout.pxd",
    "fastmq/vllm/fastmq-vllm.pth", "fastmq/py.typed",
]

# The sdist's tests that run against the installed package, and why these:
# an end-to-end queue from a writer to two spawned readers with every message
# kind (ring, out-of-band, overflow socket, tensors), the README example as a user
# runs it, a corrupt chunk against the compiled validation, the segment
# lifetimes, cleanup and ls reading headers through the compiled read-only
# code.  The vLLM integration tests are left out (they need vLLM's tree);
# the long fault and wakeup suites are too (minutes on a 2-core machine)
# and add nothing about packaging that these lack.  One parameter of the
# end-to-end test (two readers) keeps the run short.
SUBSET = [
    "tests/test_core.py::test_mixed_messages_to_local_readers[2]",
    "tests/test_core.py::test_tensor_semantics_in_process",
    "tests/test_core.py::test_corrupt_chunk_raises_and_queue_survives",
    "tests/test_core.py::test_segments_released_on_gc",
    "tests/test_readme.py::test_standalone_example_runs",
    "tests/test_lifetime.py::test_cleanup_has_nothing_to_do_and_says_so",
    "tests/test_ls.py::test_positions_from_the_counters",
    "tests/test_ls.py::test_ls_reports_unreadable_segments",
]


def _run(cmd, cwd, env=None, timeout=900):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


def _clean_env() -> dict:
    # Nothing may point back at this checkout.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _elf_sections(data: bytes) -> set[str]:
    """Section names of a 64-bit little-endian ELF file."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    str_off, str_size = headers[shstrndx][4], headers[shstrndx][5]
    strtab = data[str_off:str_off + str_size]
    return {strtab[h[0]:strtab.index(b"\0", h[0])].decode() for h in headers}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # cwd is the checkout: setuptools builds from the tree it is run in.
    _run([sys.executable, "-c",
          f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"],
         cwd=ROOT, env=_clean_env())
    sdists = list(out.glob("*.tar.gz"))
    assert len(sdists) == 1, sdists
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-cache-dir", "-q", "-w", str(out), str(sdists[0])], cwd=out, env=_clean_env())
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return sdists[0], wheels[0]


def test_sdist_has_everything_to_build_and_test(built):
    sdist, _ = built
    assert sdist.name == "vllm_fastmq-0.1.0.tar.gz"
    with tarfile.open(sdist) as t:
        names = t.getnames()
    top = names[0].split("/")[0]
    files = {n[len(top) + 1:] for n in names if n.startswith(top + "/")}
    missing = [f for f in SDIST_REQUIRED if f not in files]
    assert not missing, f"sdist lacks {missing}"
    if (ROOT / ".git").exists() and shutil.which("git"):
        tracked = _run(["git", "ls-files"], cwd=ROOT).stdout.split()
        assert not [f for f in tracked if f not in files and f != ".gitignore"], (
            "tracked files missing from the sdist")
    leftovers = [f for f in files if f.endswith((".c", ".so", ".pyc")) or "__pycache__" in f]
    assert not leftovers, f"build outputs in the sdist: {leftovers}"
    pkg_info = [n for n in names if n == f"{top}/PKG-INFO"]
    with tarfile.open(sdist) as t:
        meta = email.parser.Parser().parsestr(t.extractfile(pkg_info[0]).read().decode())
    assert meta["Name"] == DIST
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in meta.get_all("License-File")


def test_wheel_has_compiled_modules_stubs_and_no_build_leftovers(built):
    _, wheel = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        so = {m: [n for n in names if n.startswith(f"fastmq/{m}.") and n.endswith(".so")]
              for m in COMPILED}
        for m, found in so.items():
            assert len(found) == 1, f"compiled module {m}: {found}"
            sections = _elf_sections(z.read(found[0]))
            debug = sorted(s for s in sections if s.startswith(".debug") or s == ".symtab")
            assert not debug, f"{found[0]} is not stripped: {debug}"
            assert f"fastmq/{m}.pyi" in names, f"no stub for {m}"
        assert "fastmq/py.typed" in names
        assert "fastmq-vllm.pth" in names, "the .pth must sit at the root of site-packages"
        generated = sorted(n for n in names if n.endswith(".c"))
        assert not generated, f"generated C in the wheel: {generated}"
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(info).decode())
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
        licences = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert meta["Name"] == DIST and meta["License-Expression"] == "Apache-2.0"
    assert licences, "LICENSE not in the wheel"
    assert "[vllm.general_plugins]\nfastmq = fastmq.vllm.plugin:register" in entry_points
    assert "fastmq = fastmq.cli:main" in entry_points


def running_site_dirs() -> list[str]:
    """The site-packages folders of the environment running the tests (a
    virtual environment's, or the system's): where torch, pyzmq, numpy and
    pytest are."""
    return [p for p in sys.path
            if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]


def fresh_venv(venv: Path) -> str:
    """A new virtual environment that sees the packages of the running one
    but not its fastmq; its python.

    Not ``venv --system-site-packages``: from inside a virtual environment
    that shows the base interpreter's site-packages, not the running
    environment's.  A .pth file naming the running environment's folders
    appends them to sys.path after the new environment's own; plain paths,
    so the .pth files in them (an editable install of fastmq, its vLLM hook)
    are not run and fastmq can only come from what is installed here."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv.parent)
    py = str(venv / "bin" / "python")
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=venv.parent).stdout.strip()
    (Path(site) / "running-environment.pth").write_text("\n".join(running_site_dirs()) + "\n")
    return py


def test_a_fresh_venv_sees_the_running_environments_packages(tmp_path):
    """Run from a virtual environment, ``venv --system-site-packages``
    would show the base interpreter's packages instead (where pyzmq and
    pytest need not be)."""
    py = fresh_venv(tmp_path / "venv")
    out = _run([py, "-c", "import sys, zmq, pytest; print(sys.prefix); "
                "import importlib.util as u; print(u.find_spec('fastmq')); "
                "print('\\n'.join(sys.path))"],
               cwd=tmp_path, env=_clean_env())
    prefix, fastmq_spec, *path = out.stdout.splitlines()
    assert Path(prefix) == tmp_path / "venv"
    missing = [d for d in running_site_dirs() if d not in path]
    assert not missing, f"the venv does not see {missing}"
    assert fastmq_spec == "None", "the running environment's fastmq leaked into the venv"


def test_sdist_tests_pass_installed_in_a_fresh_venv(built, tmp_path):
    sdist, wheel = built
    # The running environment supplies torch, pyzmq, numpy and pytest;
    # fastmq itself must come from the wheel built from the sdist (checked
    # below).
    py = fresh_venv(tmp_path / "venv")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "-q",
          "--no-cache-dir", str(wheel)], cwd=tmp_path, env=_clean_env())
    with tarfile.open(sdist) as t:
        t.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    src = tmp_path / sdist.name[: -len(".tar.gz")]
    # The tests put their checkout on PYTHONPATH for the processes they
    # start; without the source package there, those import the installed one.
    shutil.rmtree(src / "fastmq")
    where = _run([py, "-c", "import fastmq, fastmq._ring as r; print(fastmq.__file__); "
                  "print(r.__file__)"], cwd=src, env=_clean_env()).stdout.split()
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=tmp_path).stdout.strip()
    assert all(Path(w).is_relative_to(site) for w in where), (where, site)
    assert (Path(site) / "fastmq-vllm.pth").exists()
    out = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET], cwd=src,
               env=_clean_env())
    assert " passed" in out.stdout and "failed" not in out.stdout, out.stdout
