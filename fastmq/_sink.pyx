"""Where the writer's pickler writes: one buffer, kept from message to
message, and the message's out-of-band buffers.

The pickler (the stdlib's C ``pickle.Pickler``) is built with a
``PickleSink`` as its file and ``PickleSink.on_buffer`` as its buffer
callback, so pickling a message allocates no stream object: the ring frames
straight from this buffer (``RingWriter.send_object``).  The sink never holds
the pickler (the pickler holds the sink): no reference cycle keeps the
arena's mapping alive until a GC pass.

The sink also knows what its pickler was built against (the size of
``copyreg.dispatch_table``, whether torch was imported yet) and whether
the pickler's last dump failed: ``needs_new_pickler`` tells the writer's
encoder to build a fresh one before the next message.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize,
                            PyBytes_GET_SIZE)
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

cdef enum:
    FIRST_CAP = 4096
    # A buffer grown past this for one big stream shrinks back before the
    # next message: a queue that once sent a huge in-band message does
    # not hold that much memory for the rest of its life.
    KEEP_CAP = 1 << 20


cdef class PickleSink:
    """``PickleSink(to_slot=None, commit=None, abort=None, oob_min=1 MiB)``.

    ``to_slot(buf)`` (the tensor arena's ``copy_to_slot``) is asked first
    for every ``PickleBuffer`` and may return a slot descriptor to send out
    of band instead; ``commit()`` (the arena's) is called once a message is
    published, so its slots belong to the readers, and ``abort()`` when
    sending it failed before anything was published, so they are free.
    Out-of-band buffers of ``oob_min`` bytes and more travel beside the
    stream, smaller ones in band."""

    def __cinit__(self, to_slot=None, commit=None, abort=None, Py_ssize_t oob_min=1 << 20):
        self.buf = <char *>malloc(FIRST_CAP)
        if self.buf == NULL:
            raise MemoryError()
        self.cap = FIRST_CAP
        self.size = 0
        self.to_slot = to_slot
        self.commit = commit
        self.abort = abort
        self.oob_min = oob_min
        self.oob = []
        self.holding = False
        self.copyreg_table = None
        self.broken = True    # no pickler built yet

    def __dealloc__(self):
        free(self.buf)
        self.buf = NULL

    def expect(self, dict copyreg_table, bint torch_pending, dict modules):
        """The encoder built a fresh pickler against ``copyreg_table`` (as it
        is now) and, with ``torch_pending``, before torch was imported (it
        shows up in ``modules``, i.e. ``sys.modules``)."""
        self.copyreg_table = copyreg_table
        self.copyreg_len = len(copyreg_table)
        self.torch_pending = torch_pending
        self.modules = modules
        self.broken = False

    cdef bint needs_new_pickler(self) except -1:
        # Somebody registered a reducer or imported torch since the pickler
        # was built, or its last dump failed (its memo and framing can be
        # in any state).
        if self.broken or len(self.copyreg_table) != self.copyreg_len:
            return True
        return self.torch_pending and "torch" in self.modules

    def stale(self):
        """Whether the pickler must be rebuilt before the next message."""
        return self.needs_new_pickler()

    # -- the pickler's side -----------------------------------------------
    def write(self, data):
        """The pickler's ``file.write``: append ``data`` to the buffer."""
        cdef Py_buffer v
        cdef Py_ssize_t n
        if PyBytes_CheckExact(data):
            n = PyBytes_GET_SIZE(data)
            if self.size + n > self.cap:
                self.grow(self.size + n)
            memcpy(self.buf + self.size, PyBytes_AS_STRING(data), n)
            self.size += n
            return n
        PyObject_GetBuffer(data, &v, PyBUF_SIMPLE)
        try:
            n = v.len
            if self.size + n > self.cap:
                self.grow(self.size + n)
            if n >= 65536:
                with nogil:
                    memcpy(self.buf + self.size, v.buf, n)
            else:
                memcpy(self.buf + self.size, v.buf, n)
            self.size += n
        finally:
            PyBuffer_Release(&v)
        return n

    cdef int grow(self, Py_ssize_t need) except -1:
        cdef Py_ssize_t cap = self.cap
        while cap < need:
            cap *= 2
        cdef char *p = <char *>realloc(self.buf, cap)
        if p == NULL:
            raise MemoryError()
        self.buf = p
        self.cap = cap
        return 0

    def on_buffer(self, buf):
        """The pickler's ``buffer_callback``: False keeps ``buf`` out of band."""
        if self.to_slot is not None:
            self.arena_asked = True
            desc = self.to_slot(buf)
            if desc is not None:
                self.oob.append(desc)
                return False
        raw = buf.raw()
        if raw.nbytes < self.oob_min:
            return True
        self.oob.append(raw)
        return False

    # -- one message ------------------------------------------------------
    cdef int pickle(self, object pickler, object obj) except -1:
        """Pickle ``obj`` into the buffer with ``pickler`` (whose file and
        buffer callback are this sink)."""
        cdef char *p
        if self.cap > KEEP_CAP:
            p = <char *>realloc(self.buf, KEEP_CAP)
            if p != NULL:       # else keep the larger buffer: still valid
                self.buf = p
                self.cap = KEEP_CAP
        self.size = 0
        self.let_go()
        try:
            pickler.dump(obj)
        except BaseException:
            self.broken = True
            self.let_go()
            raise
        finally:
            pickler.clear_memo()
        self.holding = True
        return 0

    cdef inline int let_go(self) except -1:
        # The list is kept from message to message; only its items go.
        self.holding = False
        self.arena_asked = False
        if self.oob:
            del self.oob[:]
        return 0

    cdef int committed(self) except -1:
        # The message is published: its arena slots are the readers', and
        # its out-of-band buffers (the caller's memory) are let go.  A
        # message whose buffers the arena never saw has nothing to commit.
        cdef bint asked = self.arena_asked
        self.let_go()
        if asked and self.commit is not None:
            self.commit()
        return 0

    cdef int aborted(self) except -1:
        self.let_go()
        if self.abort is not None:
            self.abort()
        return 0

    def dump(self, pickler, obj):
        """Pickle ``obj`` and return its frames: ``[stream, oob buffer, ...]``
        (the stream as ``bytes``); the sink keeps nothing of it."""
        self.pickle(pickler, obj)
        frames = self.frames()
        self.let_go()
        return frames

    def frames(self):
        """The frames of the message in the buffer: ``[stream, oob...]``."""
        if not self.holding:
            raise RuntimeError("fastmq: no pickled message in the sink")
        return [PyBytes_FromStringAndSize(self.buf, self.size)] + self.oob

    def clear(self):
        """Let go of the message's out-of-band buffers (the caller's memory)."""
        self.let_go()

    @property
    def nbytes(self):
        """Bytes of the pickle stream in the buffer."""
        return self.size
