"""The ZMQ side of a queue end on the writer's node: socket options, the
framing of a socket message, the wait until a sent message has left this
process, and closing an end's sockets.  (Remote readers use plain TCP:
``fastmq._wire``.)

Socket messages (local overflow payloads) are::

    [header][pickle stream][out-of-band buffer ...][END]

each followed by a flush message ``[fill][mark]`` that readers skip (see
FLUSH_FILL).  header = (message id, number of payload frames).  Local overflow ids count
send attempts, so a payload the writer abandoned (its ring mark never
published) is recognised and skipped.

A message is queued frame by frame.  When something interrupts it between
frames (a socket error, an exception from a signal handler), the frames
already queued would be glued to the next message; so the message is
ended at once with an ``ABORT`` frame in place of ``END``, and a reader
drops any message whose last frame is not ``END``.
"""
from __future__ import annotations

import logging
import math
import struct
import time

import zmq

from fastmq._ring import CorruptChunkError

logger = logging.getLogger("fastmq")

RECV_SLICE_MS = 100   # socket waits re-check shutdown and the writer at this period
FLUSH_SLICE_S = 0.05  # flush waits re-check shutdown and peers at this period

HEADER = struct.Struct("<QI")

# enqueue() returns only once the message has left this process, whole: in
# the kernel's socket buffers or the reader's process, both of which
# outlive a killed writer.  Whole, because a reader's libzmq drops a
# multipart message whose last frames never came when the connection
# closes.  libzmq says so through a MessageTracker, read with its engine's
# order in mind: the engine encodes frames into batches of out_batch_size
# (8 KiB), writes a batch completely before it encodes the next, and takes
# the next frame from the pipe only while the batch it is filling has room;
# a frame is released (its tracker done) once encoded into a batch, before
# that batch is written.  So the tracked frame cannot be in the message
# itself: every message is followed by a flush message
#   [fill: more than one batch][mark: tracked]
# The fill completes the batch that holds the message's last bytes; the
# mark is taken from the pipe, and released, only after that batch was
# written.  Frames below FLUSH_MARK_BYTES are copied by pyzmq (cheap, and
# immune to later mutation); larger ones are sent zero-copy, and released
# in order before the mark, so no caller buffer is referenced once
# enqueue() returns either.
FLUSH_FILL = bytes(9 * 1024)
FLUSH_MARK_BYTES = 1024
FLUSH_MARK = bytes(FLUSH_MARK_BYTES)
END = b"\x01"     # the last frame of a whole message
ABORT = b"\x00"   # ends an interrupted message instead


def tune_publisher(sock) -> None:
    """Options of an XPUB that carries messages.

    No high-water mark: the ring bounds what a local reader can have
    outstanding (and the flush wait a payload in flight), so a limit could
    only ever drop a message whose enqueue() had returned.  NODROP makes
    any limit block instead."""
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    sock.copy_threshold = FLUSH_MARK_BYTES


def tune_subscriber(sock) -> None:
    sock.setsockopt(zmq.RCVHWM, 0)


class SocketBroken(RuntimeError):
    """A socket failed in the middle of a message and could not end it:
    the stream on it can no longer be framed."""


def send_message(sock, msg_id: int, buffers: list, copy: bool = False) -> None:
    """Queue one socket message (whole once this returns); ``send_flush``
    then tells when it has left.

    ``copy``: the payload frames are copied now (else they reference the
    caller's buffers until they leave this process).  If queueing stops
    between frames, the frames already queued are ended with ``ABORT``
    before the exception goes on (readers drop that message); if even that
    fails, ``SocketBroken`` is raised from it."""
    frames = [HEADER.pack(msg_id, len(buffers)), *buffers]
    # Set before each send, not after: an exception that lands between a
    # send and the next line must still end what may be queued (an ABORT
    # with nothing before it is a message of its own, which readers drop).
    opened = False
    try:
        for f in frames:
            opened = True
            sock.send(f, zmq.SNDMORE, copy=copy)
        sock.send(END)
        opened = False
    except BaseException:
        if opened:
            try:
                sock.send(ABORT)
            except BaseException as e:
                raise SocketBroken(
                    f"fastmq: a socket failed in the middle of message {msg_id} and the "
                    f"message could not be ended ({e!r}); this queue end cannot send "
                    "any more") from e
        raise


def send_flush(sock):
    """Queue a flush message; its tracker is done once every message queued
    before it has left this process (see FLUSH_FILL)."""
    opened = True   # (as in send_message: an ABORT alone is dropped by readers)
    try:
        sock.send(FLUSH_FILL, zmq.SNDMORE, copy=False)
        tracker = sock.send(FLUSH_MARK, copy=False, track=True)
        opened = False
        return tracker
    except BaseException:
        if opened:
            sock.send(ABORT)
        raise


def split_message(frames: list, where: str) -> tuple[int, list] | None:
    """(message id, payload frames) of a received socket message; None for
    a flush message or one its writer ended with ``ABORT`` (to be dropped)."""
    last = frames[-1]
    if len(last) != 1 or (last.bytes if hasattr(last, "bytes") else bytes(last)) != END:
        return None
    head = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
    if len(head) != HEADER.size:
        raise CorruptChunkError(f"fastmq: {where}: a socket message has a "
                                f"{len(head)}-byte header, expected {HEADER.size}")
    msg_id, n = HEADER.unpack(head)
    if not 1 <= n <= len(frames) - 2:
        raise CorruptChunkError(f"fastmq: {where}: message {msg_id} names {n} payload "
                                f"frames but carries {len(frames) - 1}")
    return msg_id, frames[1:1 + n]


def describe_handshake_frames(frames: list) -> str:
    """What a reader received instead of READY, for the late-join error."""
    if len(frames) >= 2 and len(frames[0]) == HEADER.size:
        return f"message {HEADER.unpack(frames[0])[0]}"
    return f"{len(frames)} frames"


def deadline(timeout: float | None) -> float | None:
    if timeout is None or not math.isfinite(timeout):
        return None
    return time.monotonic() + max(timeout, 0.0)


def remaining(until: float | None) -> float | None:
    """The timeout left until ``until`` (a ``deadline``)."""
    return None if until is None else max(until - time.monotonic(), 0.0)


def flush_slice(tracker, until: float | None, where: str) -> bool:
    """Wait one slice for the message of ``tracker`` to leave this process:
    True once it has; raises ``TimeoutError`` once ``until`` has passed
    (``where`` names the socket in its message).  The caller owns the loop
    and what it checks between slices (shutdown, the readers' liveness)."""
    if tracker.done:
        return True
    wait = FLUSH_SLICE_S
    if until is not None:
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"fastmq: a reader did not take the message from "
                               f"{where} in time")
        wait = min(wait, left)
    try:
        tracker.wait(wait)
        return True
    except zmq.NotDone:
        return False


def close_all(context, sockets) -> None:
    """Close an end's sockets and context.

    linger=0 loses nothing: enqueue() returned only after its message left
    the process (see FLUSH_FILL).  Not run at interpreter exit (pyzmq's
    term() can hang there when the context and its sockets are collected
    together); the ipc endpoints have no files, so nothing is left then.
    Teardown errors cannot be acted on, but are logged rather than dropped."""
    for s in sockets:
        try:
            s.close(linger=0)
        except Exception as e:
            logger.debug("fastmq: closing a queue socket failed: %r", e)
    try:
        if context is not None:
            context.term()
    except Exception as e:
        logger.debug("fastmq: terminating a queue's ZMQ context failed: %r", e)
