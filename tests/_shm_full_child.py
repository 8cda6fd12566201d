"""Run as a script inside a private mount namespace whose /dev/shm is a
small tmpfs (see test_hostile.py): fills /dev/shm after the queue was
created and checks that the writer gets an exception, not a SIGBUS."""
import os
import sys
import threading

from fastmq import MessageQueue
from fastmq._shm import ShmFullError

MiB = 1 << 20


def main() -> None:
    w = MessageQueue(1, 1, max_chunk_bytes=3 * MiB, max_chunks=2,
                     enable_shm_tensor_arena=False)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=w.wait_until_ready)
    t.start()
    r.wait_until_ready()
    t.join(10)
    w.enqueue(b"small")
    # Another process fills /dev/shm after the queue passed its space check.
    filler = "/dev/shm/filler"
    st = os.statvfs("/dev/shm")
    with open(filler, "wb") as f:
        f.write(b"\1" * (st.f_bavail * st.f_frsize - MiB // 2))
    big = bytes(range(256)) * (10 * 1024)         # 2.5 MiB: chunk 1, never touched
    try:
        w.enqueue(big)
    except ShmFullError as e:
        print("ERROR:", e)
        assert "/dev/shm" in str(e) and "MiB" in str(e), e
    else:
        raise AssertionError("enqueue into a full /dev/shm did not raise")
    os.unlink(filler)
    w.enqueue(big)                                # usable again once space is back
    assert r.dequeue(timeout=10) == b"small"
    assert r.dequeue(timeout=10) == big           # exactly once, after the failure
    try:
        r.dequeue(timeout=0.2)
    except TimeoutError:
        pass
    else:
        raise AssertionError("the failed enqueue delivered a message")
    print("OK")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
