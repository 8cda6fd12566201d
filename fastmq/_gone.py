"""How the other end of a queue went away: the errors that say so.

Both are ``RuntimeError`` subclasses, as the plain ``RuntimeError`` that
vLLM's own queue raises in their place, so that callers catching that keep
working; the attributes let a caller tell them apart without parsing text.
"""
from __future__ import annotations


class WriterGoneError(RuntimeError):
    """A remote reader's writer is gone: it shut the queue down (``clean``)
    or its connection was cut, or nothing came from it for the bound
    (``FASTMQ_PEER_TIMEOUT_S``: its node died or became unreachable; not
    ``clean``, so that whoever ends a worker whose writer is gone treats it
    as a cut connection).  No message will come; a remote reader cannot
    rejoin a running queue."""

    def __init__(self, message: str, clean: bool):
        super().__init__(message)
        self.clean = clean


class ReaderGoneError(RuntimeError):
    """A reader the writer must deliver to is gone, so the writer cannot
    make progress: ``how`` is ``"died"`` (its process ended without closing
    its end), ``"left"`` (it closed its end of the queue), or, for a remote
    reader after the handshake, ``"disconnected"`` (its connection closed
    or broke), ``"silent"`` (nothing came from it for the bound,
    ``FASTMQ_PEER_TIMEOUT_S``: its node died or became unreachable) or
    ``"misbehaved"`` (it sent bytes it must not send).
    ``rank`` is its reader rank, ``pid`` its process id (on its own node
    for a remote reader; None where unknown)."""

    def __init__(self, message: str, rank: int, pid: int | None, how: str):
        super().__init__(message)
        self.rank, self.pid, self.how = rank, pid, how

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.pid, self.how)
