"""What one remote reader's connection still owes it: the queued wire
parts and how far the socket has taken them.

Why in Cython: the writer decides whether a message is committed (some of
its bytes reached a reader) from ``sent``.  A Python signal handler can
raise between any two bytecodes, so if ``sendmsg`` returned in Python and
the count (or the queue's position) were updated after it, an exception in
between would leave bytes on the wire that the writer does not know of:
the message would be dropped as unsent while a reader has part of it (and
the next one would repeat those bytes).  Here ``sendmsg``, the count and
the position change in one native call, with no bytecode between them.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.exc cimport PyErr_SetFromErrno
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from posix.uio cimport iovec


cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        void *msg_name
        unsigned int msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)
    int MSG_NOSIGNAL
    int MSG_DONTWAIT


cdef enum:
    IOV_MAX_PARTS = 512
    # Written parts are dropped from the list's front in runs this long.
    COMPACT_AFTER = 64


cdef class Outbox:
    """A FIFO of buffers owed to one connection.

    ``add(batch)`` queues a batch of parts and counts it (``batches``);
    ``write(fd)`` writes what the socket takes now; ``sent`` counts the
    bytes written since ``mark()``; ``owed`` says whether any are left."""

    cdef list parts
    cdef Py_ssize_t head      # the first part not wholly written
    cdef Py_ssize_t off       # bytes of parts[head] already written
    cdef readonly unsigned long long sent
    cdef readonly Py_ssize_t batches
    cdef Py_buffer *views
    cdef iovec *iov

    def __cinit__(self):
        self.parts = []
        self.views = <Py_buffer *>malloc(IOV_MAX_PARTS * sizeof(Py_buffer))
        self.iov = <iovec *>malloc(IOV_MAX_PARTS * sizeof(iovec))
        if self.views == NULL or self.iov == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.views)
        free(self.iov)

    @property
    def owed(self):
        return self.head < len(self.parts)

    def mark(self):
        """A new message starts: ``sent`` and ``batches`` count from zero."""
        self.sent = 0
        self.batches = 0

    def add(self, list batch):
        """Queue ``batch`` (a list of buffers) and count it, at once."""
        self.parts.extend(batch)
        self.batches += 1

    def clear(self):
        self.parts = []
        self.head = self.off = 0

    def own_rest(self, dict copies):
        """Replace every part still owed by a ``bytes`` copy (one copy per
        distinct object, kept in ``copies`` across outboxes), so that none
        references the caller's memory; the position is kept."""
        cdef list rest = []
        cdef Py_ssize_t i
        for i in range(self.head, len(self.parts)):
            p = self.parts[i]
            if i == self.head and self.off:
                p = bytes(memoryview(p).cast("B")[self.off:])
            elif not isinstance(p, bytes):
                key = id(p)
                if key not in copies:
                    copies[key] = (p, bytes(p))
                p = copies[key][1]
            rest.append(p)
        self.parts = rest
        self.head = self.off = 0

    def write(self, int fd):
        """Write what the socket takes now; how many bytes.  ``OSError``
        (``BrokenPipeError``, ``ConnectionResetError``, ...) if the
        connection broke."""
        cdef Py_ssize_t total = 0, n, i, got
        cdef ssize_t r
        cdef size_t left
        cdef msghdr msg
        while self.head < len(self.parts):
            n = min(len(self.parts) - self.head, <Py_ssize_t>IOV_MAX_PARTS)
            got = 0
            try:
                for i in range(n):
                    PyObject_GetBuffer(self.parts[self.head + i], &self.views[i], PyBUF_SIMPLE)
                    got += 1
                    self.iov[i].iov_base = self.views[i].buf
                    self.iov[i].iov_len = <size_t>self.views[i].len
                self.iov[0].iov_base = <char *>self.iov[0].iov_base + self.off
                self.iov[0].iov_len -= <size_t>self.off
                memset(&msg, 0, sizeof(msg))
                msg.msg_iov = self.iov
                msg.msg_iovlen = <size_t>n
                with nogil:
                    r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
                if r < 0:
                    if errno == EAGAIN or errno == EINTR:   # (EWOULDBLOCK is EAGAIN on Linux)
                        return total
                    PyErr_SetFromErrno(OSError)
                    return None   # not reached: the line above raised
                # The count and the position move with the write, before
                # any bytecode can run.
                self.sent += <unsigned long long>r
                total += r
                left = <size_t>r
                i = 0
                while i < n:
                    # (an empty part is passed over as soon as it is reached)
                    if left >= self.iov[i].iov_len:
                        left -= self.iov[i].iov_len
                        self.head += 1
                        self.off = 0
                        i += 1
                    else:
                        self.off += <Py_ssize_t>left
                        break
            finally:
                for i in range(got):
                    PyBuffer_Release(&self.views[i])
            if self.head >= COMPACT_AFTER:
                del self.parts[:self.head]
                self.head = 0
        self.parts = []
        self.head = self.off = 0
        return total
