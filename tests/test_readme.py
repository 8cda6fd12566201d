"""The README's promises: its standalone example runs, and CI runs exactly
its test command."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _block_after(marker: str) -> str:
    i = README.index(marker)
    m = re.compile(r"```python\n(.*?)```", re.S).search(README, i)
    return m.group(1)


def test_standalone_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_block_after("<!-- example:standalone"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.split("\n"))
    expected = sorted(f"rank {r} got step {s}" for r in range(2) for s in range(3))
    assert [ln for ln in lines if ln] == expected


def test_ci_runs_the_readme_test_command():
    quick = README[README.index("## Quick start"):README.index("## Standalone")]
    cmds = [ln.split("#")[0].strip() for ln in quick.splitlines()
            if not ln.startswith("`")]
    test_cmd = next(c for c in cmds if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_cmd
