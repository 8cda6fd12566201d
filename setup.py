"""Build fastmq's Cython extensions; metadata lives in pyproject.toml.

FASTMQ_DEBUG=1 builds with -O0 -g, bounds checks and AddressSanitizer.
"""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

DEBUG = os.environ.get("FASTMQ_DEBUG", "0") == "1"

# A release build carries no debug info and strips its symbols (-g0 wins over
# the -g that Python's own CFLAGS usually bring): the modules shrink several
# times over.
compile_args = ["-O0", "-g", "-fsanitize=address"] if DEBUG else ["-O3", "-g0"]
link_args = ["-fsanitize=address"] if DEBUG else ["-Wl,-s"]
libraries = ["rt", "dl"] if sys.platform.startswith("linux") else []

MODULES = ["_memory", "_segment", "_sink", "_recv_buffers", "_gmac", "_outbox", "_ring",
           "_ring_writer", "_ring_reader", "_arena", "_arena_pages", "_arena_writer",
           "_arena_reader", "_snapshot", "_floor"]


def ext(name):
    return Extension(
        f"fastmq.{name}",
        [f"fastmq/{name}.pyx"],
        include_dirs=["fastmq/_native"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        libraries=libraries,
    )


# Swaps fastmq into vLLM in every process (see fastmq/vllm/_hook.py).  A .pth
# works only at the top of site-packages, which no package-data rule reaches.
PTH = "fastmq/vllm/fastmq-vllm.pth"


class build_py_with_pth(build_py):
    """Also put ``PTH`` at the root of what gets installed: ``build_lib``
    for a wheel; for ``pip install -e`` (where setuptools ignores
    ``build_lib``), the editable wheel's root, which is ``install_lib``."""

    def run(self):
        super().run()
        self.copy_file(PTH, self._pth_target(), preserve_mode=False)

    def _pth_target(self):
        if getattr(self, "editable_mode", False):
            root = self.get_finalized_command("install").install_lib
        else:
            root = self.build_lib
        return os.path.join(root, os.path.basename(PTH))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(self._pth_target())
        return outputs


setup(
    cmdclass={"build_py": build_py_with_pth},
    ext_modules=cythonize(
        [ext(m) for m in MODULES if os.path.exists(f"fastmq/{m}.pyx")],
        compiler_directives={
            "language_level": 3,
            "embedsignature": True,
            "boundscheck": DEBUG,
            "wraparound": DEBUG,
            "initializedcheck": DEBUG,
        },
    ),
)
