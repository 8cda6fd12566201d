"""What vLLM needs at run time on a CPU-only machine, read from the wheel.

vLLM is installed with ``--no-deps`` (its declared torch is a CUDA build and
several of its requirements are CUDA-only kernels).  This script reads the
installed wheel's ``Requires-Dist`` (``importlib.metadata``), keeps the
entries whose environment markers hold here and that no extra asks for,
drops the torch family and the CUDA-only packages named below, and writes:

* ``<out>/vllm-requirements.txt``: what to ``pip install``;
* ``<out>/vllm-constraints.txt``: the installed torch build pinned, so that
  nothing in the list can pull another torch, and vLLM's own pins of the
  packages left out, so that one pulled in by another requirement (xgrammar
  needs apache-tvm-ffi) is the version vLLM declares.

Every name in the exclusion lists must still be declared by the wheel: a
name vLLM stopped requiring fails the run, so the lists cannot rot.

    python3 .ci/vllm_deps.py OUT_DIR          # write both files, print a summary
    python3 .ci/vllm_deps.py --check          # only check the exclusions
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

VLLM_VERSION = "0.33.0"

# Installed separately, as the CPU build; never replaced.
TORCH_FAMILY = ("torch", "torchaudio", "torchvision", "torchcodec")
# Kernels and tools that exist only for CUDA (or only as CUDA wheels).
CUDA_ONLY = ("flashinfer-python", "apache-tvm-ffi", "tilelang", "nvtx", "fastsafetensors",
             "instanttensor", "quack-kernels", "tokenspeed-mla", "humming-kernels",
             "pynvvideocodec")
CUDA_ONLY_PREFIXES = ("nvidia-",)


def _excluded(name: str) -> str | None:
    if name in TORCH_FAMILY:
        return "torch family (the CPU build is installed separately)"
    if name in CUDA_ONLY or name.startswith(CUDA_ONLY_PREFIXES):
        return "CUDA only"
    return None


def resolve() -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(requirements to install, (requirement, why) dropped, problems)."""
    try:
        dist = metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        return [], [], ["vllm is not installed (pip install --no-deps vllm==%s)" % VLLM_VERSION]
    problems = []
    if dist.version != VLLM_VERSION:
        problems.append(f"vllm {dist.version} is installed, this list is for {VLLM_VERSION}")
    keep, dropped, declared = [], [], set()
    for line in dist.requires or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue        # another platform or Python, or an extra
        declared.add(name)
        why = _excluded(name)
        if why:
            dropped.append((str(req), why))
        else:
            keep.append(str(req))
    for name in TORCH_FAMILY + CUDA_ONLY:
        if name not in declared:
            problems.append(f"{name} is excluded here but vllm {dist.version} no longer "
                            "requires it: update .ci/vllm_deps.py")
    if not any(n.startswith(CUDA_ONLY_PREFIXES) for n in declared):
        problems.append("no nvidia-* requirement left in vllm's metadata: update "
                        ".ci/vllm_deps.py")
    return keep, dropped, problems


def constraints(dropped: list[tuple[str, str]]) -> list[str]:
    """Pins for what is installed of the torch family (a local ``+cpu``
    version pins exactly that build), then vLLM's specifiers of the other
    packages left out (constraints take no extras)."""
    out = []
    for name in TORCH_FAMILY:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    for line, _ in dropped:
        req = Requirement(line)
        if canonicalize_name(req.name) in TORCH_FAMILY or not req.specifier:
            continue
        marker = f"; {req.marker}" if req.marker else ""
        out.append(f"{req.name}{req.specifier}{marker}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="directory for the two files")
    ap.add_argument("--check", action="store_true", help="only check the exclusion lists")
    args = ap.parse_args(argv)
    keep, dropped, problems = resolve()
    for p in problems:
        print(f"vllm_deps: {p}", file=sys.stderr)
    if problems:
        return 1
    if args.check:
        print(f"vllm_deps: {len(keep)} requirements, {len(dropped)} excluded, lists current")
        return 0
    if not args.out:
        ap.error("give an output directory, or --check")
    pins = constraints(dropped)
    if not any(p.startswith("torch==") for p in pins):
        print("vllm_deps: torch is not installed; install the CPU build first", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vllm-requirements.txt"), "w") as f:
        f.write("# generated by .ci/vllm_deps.py from vllm's Requires-Dist\n")
        f.writelines(r + "\n" for r in keep)
    with open(os.path.join(args.out, "vllm-constraints.txt"), "w") as f:
        f.write("# generated by .ci/vllm_deps.py: the installed torch family; vLLM's pins of what is left out\n")
        f.writelines(p + "\n" for p in pins)
    print(f"vllm_deps: {len(keep)} requirements; excluded: "
          + ", ".join(f"{r} ({why})" for r, why in dropped))
    print(f"vllm_deps: constraints: {', '.join(pins)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
