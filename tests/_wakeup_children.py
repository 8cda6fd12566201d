"""Reader bodies for test_wakeup: random pauses, safety net switched off."""
from __future__ import annotations

import random

NO_SAFETY_NET_NS = 600 * 10**9


def paused_reader(handle, rank, count, seed, result_q):
    import time

    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    # With the periodic re-check stretched to 10 minutes, a lost wakeup shows
    # up as a TimeoutError instead of a 100 ms hiccup.
    mq._ring.park_slice_ns = NO_SAFETY_NET_NS
    mq.wait_until_ready()
    rng = random.Random(seed)
    bad = 0
    for i in range(count):
        if mq.dequeue(timeout=30) != i:
            bad += 1
        r = rng.random()
        if r < 0.3:
            time.sleep(rng.uniform(0, 0.002))
        elif r < 0.35:
            time.sleep(0.01)
    result_q.put((rank, bad))


def busy_reader(handle, rank, count, result_q):
    from fastmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    got = sum(mq.dequeue(timeout=30) == i for i in range(count))
    result_q.put((rank, got))
