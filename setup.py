"""Build fastmq's Cython extensions; metadata lives in pyproject.toml.

FASTMQ_DEBUG=1 builds with -O0 -g, bounds checks and AddressSanitizer.
"""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("FASTMQ_DEBUG", "0") == "1"

compile_args = ["-O0", "-g", "-fsanitize=address"] if DEBUG else ["-O3"]
link_args = ["-fsanitize=address"] if DEBUG else []
libraries = ["rt"] if sys.platform.startswith("linux") else []

MODULES = ["_shm", "_ring", "_arena", "_floor"]


def ext(name):
    return Extension(
        f"fastmq.{name}",
        [f"fastmq/{name}.pyx"],
        include_dirs=["fastmq/_native"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        libraries=libraries,
    )


setup(
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
