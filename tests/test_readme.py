"""The README's and docs/' promises: every Python example in them runs as
written, their links lead somewhere, and CI runs exactly the README's test
command."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
# An example preceded by `<!-- example:NAME` has its own test below, which
# also checks what it prints; every other Python block just has to run.
MARKER = re.compile(r"<!-- example:(\w+)[^>]*-->\n```python\n")
MARKED_TESTS = {"standalone": "test_standalone_example_runs", "arena": "test_arena_example_runs"}


def _block_after(marker: str) -> str:
    i = README.index(marker)
    m = PYTHON_BLOCK.search(README, i)
    return m.group(1)


def _unmarked_blocks():
    for path in DOCS:
        text = path.read_text()
        marked = {m.end() for m in MARKER.finditer(text)}
        for n, m in enumerate(PYTHON_BLOCK.finditer(text)):
            if m.start() + len("```python\n") not in marked:
                yield pytest.param(m.group(1), id=f"{path.relative_to(ROOT)}:{n}")


EXAMPLE_LINE = re.compile(r"rank (\d+) got step (\d+)")
EXPECTED = sorted(f"rank {r} got step {s}" for r in range(2) for s in range(3))


def _example_lines(stdout: str) -> list[str]:
    """The example's lines in ``stdout``, sorted.  Two readers print into one
    pipe; unbuffered (PYTHONUNBUFFERED=1), ``print`` writes the text and the
    newline separately, so lines can interleave ("rank 0 got step 0rank 1
    got step 0\n\n"): each piece of text is one write and stays whole, the
    line breaks between them do not."""
    return sorted(m.group(0) for m in EXAMPLE_LINE.finditer(stdout))


def test_example_lines_survive_interleaved_prints():
    interleaved = ("rank 0 got step 0rank 1 got step 0\n\nrank 1 got step 1\n"
                   "rank 0 got step 1rank 1 got step 2\n\nrank 0 got step 2\n")
    assert _example_lines(interleaved) == EXPECTED
    assert _example_lines("rank 0 got step 0\n") != EXPECTED


def _write_example(tmp_path, name: str = "standalone") -> Path:
    script = tmp_path / "example.py"
    script.write_text(_block_after(f"<!-- example:{name}"))
    return script


def _run(cmd, tmp_path):
    # Unbuffered, as on machines that set PYTHONUNBUFFERED=1: the case where
    # the readers' lines interleave.
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)


def test_standalone_example_runs(tmp_path):
    out = _run([sys.executable, str(_write_example(tmp_path))], tmp_path)
    assert out.returncode == 0, out.stderr
    assert _example_lines(out.stdout) == EXPECTED, out.stdout


ARENA_LINE = re.compile(r"rank (\d) got \(1024, 1024\), sum (\d+)")


def test_arena_example_runs(tmp_path):
    pytest.importorskip("torch")
    out = _run([sys.executable, str(_write_example(tmp_path, "arena"))], tmp_path)
    assert out.returncode == 0, out.stderr
    got = sorted(ARENA_LINE.findall(out.stdout))
    assert got == [("0", str(1 << 20)), ("1", str(1 << 20))], out.stdout
    # The tensor went through the arena, not the ring or a socket.
    assert "arena hits: 1" in out.stdout, out.stdout


def test_every_marked_example_has_its_test():
    names = {m.group(1) for p in DOCS for m in MARKER.finditer(p.read_text())}
    assert names == set(MARKED_TESTS)
    assert all(callable(globals()[t]) for t in MARKED_TESTS.values())


@pytest.mark.parametrize("code", list(_unmarked_blocks()))
def test_python_block_runs(code, tmp_path):
    if "fastmq.vllm" in code:
        pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    script = tmp_path / "block.py"
    script.write_text(code)
    out = _run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 0, out.stderr


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve():
    bad = []
    for path in DOCS:
        for target in LINK.findall(path.read_text()):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.name}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                heads = {_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in heads:
                    bad.append(f"{path.name}: {target} (no such heading)")
    assert not bad, bad


def _can_mount_private_shm() -> str | None:
    """Why a private 64 MiB /dev/shm cannot be made here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
        capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return ("a private mount namespace with its own /dev/shm is not permitted here "
                f"(needs root or CAP_SYS_ADMIN): {probe.stderr.strip()}")
    return None


def test_standalone_example_runs_on_a_64_mib_dev_shm(tmp_path):
    """A default Docker container has a 64 MiB /dev/shm: the example runs
    there.  The example runs in a private mount namespace whose /dev/shm
    is a fresh 64 MiB tmpfs (the host's is untouched)."""
    why = _can_mount_private_shm()
    if why:
        pytest.skip(why)
    script = _write_example(tmp_path)
    inner = ("mount -t tmpfs -o size=64m tmpfs /dev/shm && df -B1 --output=size /dev/shm "
             f"&& exec {shlex.quote(sys.executable)} {shlex.quote(str(script))}")
    out = _run(["unshare", "-m", "sh", "-c", inner], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["1B-blocks", str(64 << 20)], out.stdout
    assert _example_lines(out.stdout) == EXPECTED, out.stdout


def test_ci_runs_the_readme_test_command():
    quick = README[README.index("## Quick start"):README.index("## Using fastmq in vLLM")]
    cmds = [ln.split("#")[0].strip() for ln in quick.splitlines()
            if not ln.startswith("`")]
    test_cmd = next(c for c in cmds if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_cmd


def test_readme_leads_with_the_user():
    """What fastmq is, the quick start, the vLLM switch, the standalone
    example, then one generated table of the headline figures (its
    generation is checked in tests/test_bench.py); under 220 lines."""
    lines = README.splitlines()
    assert len(lines) < 220, len(lines)
    heads = [ln for ln in lines if ln.startswith("## ")]
    assert heads[:4] == ["## Quick start", "## Using fastmq in vLLM",
                         "## Standalone: one writer, N readers, no vLLM", "## Figures"], heads
    assert README.index("pip install vllm-fastmq") < README.index("<!-- example:standalone")
    begin = README.index("<!-- fastmq-bench --readme")
    block = README[begin:README.index("<!-- end of fastmq-bench --readme -->")]
    table = [ln for ln in block.splitlines() if ln.startswith("|")]
    assert table[0] == "| figure | fastmq | vLLM | vs vLLM |"
    assert 1 <= len(table) - 2 <= 8, table
    assert sum(1 for ln in block.splitlines() if ln.startswith("| figure")) == 1
    assert "fastmq is slower than vLLM" in block or "faster than vLLM in every" in block
    assert "Generated by `fastmq-bench --readme bench/results.json" in block
