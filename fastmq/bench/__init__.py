"""fastmq measured side by side with vLLM 0.33.0's MessageQueue and the floors."""

# (``main`` lives in ``__main__``; importing it here would make
# ``python -m fastmq.bench`` import that module twice.)
