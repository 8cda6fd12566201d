"""``fastmq-bench``: fastmq measured side by side with vLLM 0.33.0's
``MessageQueue``, plain pyzmq and the hardware floors, in one run.

    fastmq-bench                      # default scenarios, < 2 min on 2 cores
    fastmq-bench --quick              # smoke run
    fastmq-bench --full --json out.json --plot plots/ --results-md bench/RESULTS.md

Modules: ``config`` (presets), ``impls`` (the implementations behind one
interface), ``harness`` (reader processes, timeouts, statistics),
``verify`` (what readers check), one module per scenario (``step``,
``throughput``, ``tensor``, ``wake``), ``floors``, ``report``, ``plots``,
``machine``, ``progress`` and ``runner`` (one run).
"""

# (``main`` lives in ``__main__``; importing it here would make
# ``python -m fastmq.bench`` import that module twice.)
