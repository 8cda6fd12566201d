"""vLLM's ``vllm.general_plugins`` entry point (``fastmq`` in pyproject.toml).

vLLM calls ``register()`` once in each process it starts (engine core,
workers), after ``VLLM_PLUGINS`` has selected it.  Most of the time the
import hook has already swapped the classes and this only confirms it; it
matters where the hook is not installed (an interpreter started with
``-S``, a site without the .pth).

A plugin that raises aborts vLLM's start-up, so this one raises only in
one case: fastmq is active but cannot make the tensor arena vLLM's default
because the symbols it relies on moved (``ArenaDefaultError`` naming them;
running on with a half-applied fastmq is worse; ``FASTMQ_VLLM=0`` runs
vLLM as it ships).  A vLLM whose queue API differs from fastmq's, or a
fastmq that cannot load, is logged as an error and vLLM keeps its own
``MessageQueue``.  (If another process of the same deployment does use
fastmq, attaching across the two fails at once with ``HandleMismatchError``
naming both sides.)
"""
from __future__ import annotations

import logging

logger = logging.getLogger("fastmq")


def register() -> None:
    try:
        from fastmq import vllm as fastmq_vllm
        from fastmq.vllm._arena_default import ArenaDefaultError
    except Exception:
        logger.exception("fastmq is not active in this process: loading it failed; "
                         "vLLM keeps its own MessageQueue")
        return
    try:
        fastmq_vllm.patch(_source="vLLM plugin")
    except ArenaDefaultError:
        raise
    except (RuntimeError, ValueError) as e:     # vLLM's API changed; a bad FASTMQ_VLLM
        logger.error("fastmq is not active in this process: %s", e)
    except Exception:
        logger.exception("fastmq is not active in this process: loading it failed; "
                         "vLLM keeps its own MessageQueue")
