"""What ``import fastmq`` costs: no torch (the queue needs it only for a
message that holds a tensor), so ``fastmq ls`` and a standalone user without
torch pay nothing for it; a tensor still takes the fast paths (raw bytes out
of band, the tensor arena) when torch is imported after fastmq, and a reader
imports torch when it first decodes one."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Heavy third-party modules none of which `import fastmq` or `fastmq ls` needs.
HEAVY = ("torch", "numpy", "vllm", "triton")


def _python(code: str, timeout: float = 120, cwd=None, python: str = sys.executable,
            env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


def test_import_fastmq_and_fastmq_ls_import_no_torch(tmp_path):
    out = _python(f"""
        import sys
        import fastmq
        after_import = sorted(m for m in {HEAVY!r} if m in sys.modules)
        from fastmq.cli import main
        main(["ls"])
        try:
            main(["--help"])
        except SystemExit:
            pass
        print("loaded:", after_import, sorted(m for m in {HEAVY!r} if m in sys.modules))
        """, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "loaded: [] []" in out.stdout, out.stdout


def test_a_tensor_takes_the_fast_paths_when_torch_comes_after_fastmq(tmp_path):
    """The writer's encoder and arena were made before torch was imported;
    the tensors still go out of band / into the arena (not through torch's
    own pickling), and a reader process that never imported torch rebuilds
    them, importing torch then."""
    script = tmp_path / "late_torch.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        import sys
        from fastmq import MessageQueue

        def reader(handle, rank):
            mq = MessageQueue.create_from_handle(handle, rank)
            mq.wait_until_ready()
            assert mq.dequeue(timeout=60) == "no torch yet"
            before = "torch" in sys.modules
            for _ in range(3):
                t = mq.dequeue(timeout=60)
                print(f"reader: torch before {before}, {type(t).__module__}."
                      f"{type(t).__name__} {tuple(t.shape)} sum {int(t.sum())}", flush=True)

        if __name__ == "__main__":
            assert "torch" not in sys.modules
            mq = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=4,
                              arena_slots=2, arena_slot_mb=8, arena_min_mb=2)
            p = mp.get_context("spawn").Process(target=reader, args=(mq.export_handle(), 0))
            p.start()
            mq.wait_until_ready()
            mq.enqueue("no torch yet")     # the encoder's first pickler has no tensor reducer
            import torch
            small = torch.ones(300_000, dtype=torch.int32)    # 1.2 MiB: out of band
            big = torch.ones(1 << 20, dtype=torch.int32)      # 4 MiB: the arena
            mq.enqueue(small)
            mq.enqueue(big)
            mq.enqueue(torch.ones(4))                          # in band
            p.join(60)
            stats = mq.stats()
            print("exit", p.exitcode, "arena hits", stats["arena_hits"], flush=True)
            mq.shutdown()
        """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines == [
        "reader: torch before False, torch.Tensor (300000,) sum 300000",
        "reader: torch before False, torch.Tensor (1048576,) sum 1048576",
        "reader: torch before False, torch.Tensor (4,) sum 4",
        "exit 0 arena hits 1",
    ], out.stdout + out.stderr[-3000:]


def test_the_encoder_picks_up_torch_imported_after_it():
    out = _python("""
        import pickle, sys
        from fastmq._serde import Encoder, rebuild_tensor
        enc = Encoder()
        enc.encode({"warm": 1})
        import torch
        frames = enc.encode(torch.arange(300_000, dtype=torch.int64))
        # Raw bytes out of band, rebuilt by fastmq's own function.
        assert len(frames) == 2 and memoryview(frames[1]).nbytes == 2_400_000, frames[1:]
        assert b"rebuild_tensor" in frames[0], frames[0][:200]
        t = pickle.loads(frames[0], buffers=frames[1:])
        assert torch.equal(t, torch.arange(300_000, dtype=torch.int64))
        print("ok")
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _venv_without_torch(tmp_path: Path) -> Path:
    """A fresh virtual environment (no system site-packages) with what a
    standalone user installs (pyzmq, numpy) and this checkout's fastmq, and
    no torch."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "pyzmq>=25", "numpy"],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    # This checkout's package (built in place), and nothing else of it: a
    # folder holding only a link to the package, named by a .pth file.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    import fastmq

    (pkg / "fastmq").symlink_to(Path(fastmq.__file__).resolve().parent)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    Path(site.stdout.strip(), "fastmq-checkout.pth").write_text(f"{pkg}\n")
    return py


def test_the_standalone_example_runs_in_a_venv_without_torch(tmp_path):
    from test_readme import EXPECTED, _block_after, _example_lines

    py = _venv_without_torch(tmp_path)
    check = subprocess.run([str(py), "-c", "import importlib.util as u, fastmq; "
                            "print(u.find_spec('torch'), fastmq.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith("None "), check.stdout   # no torch in this venv
    script = tmp_path / "example.py"
    script.write_text(_block_after("<!-- example:standalone"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run([str(py), str(script)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert _example_lines(out.stdout) == EXPECTED, out.stdout
