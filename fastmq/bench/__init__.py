"""``fastmq-bench``: fastmq measured side by side with vLLM 0.33.0's
``MessageQueue``, plain pyzmq and the hardware floors, in one run.

Modules: ``config`` (presets), ``impls`` (the implementations behind one
interface), ``harness`` (reader processes, timeouts, statistics),
``verify`` (what readers check), one module per scenario (``step``,
``throughput``, ``tensor``, ``wake``, ``executor``, ``generate``), each
declaring itself (``scenario.Scenario``), ``floors``, ``figures`` (ratios,
merging, JSON), ``report`` and ``readme`` (what people read), ``runner``.
"""

# (``main`` lives in ``__main__``; importing it here would make
# ``python -m fastmq.bench`` import that module twice.)
