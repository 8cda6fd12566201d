# cython: freethreading_compatible = False
"""POSIX shared-memory segments, owned by a ``cdef class``.

We map segments ourselves (``shm_open`` + ``mmap``) rather than through
``multiprocessing.shared_memory`` because:

* segments are created owner-only (``0600``) and exclusively (``O_EXCL``), so
  a name collision or a hostile pre-created file is an error, not a takeover;
* the resource tracker stays out of it: only the creator unlinks;
* the mapping's lifetime follows the buffers exported from it.  A tensor
  viewing an arena slot holds a buffer export on this object, and
  ``close()`` while exports are alive defers the ``munmap`` to the moment the
  last export is released, so no view can ever point at unmapped memory.
"""
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo
from libc.errno cimport errno, EEXIST, ENOENT
from libc.string cimport strerror
from posix.fcntl cimport O_CREAT, O_EXCL, O_RDWR
from posix.mman cimport (MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap,
                         munmap, shm_open, shm_unlink)
from posix.stat cimport fstat, struct_stat
from posix.unistd cimport close as c_close, ftruncate

import os


cdef object _os_error(int err, str what, str name):
    msg = "%s %r: %s" % (what, name, strerror(err).decode())
    if err == ENOENT:
        return FileNotFoundError(err, msg)
    if err == EEXIST:
        return FileExistsError(err, msg)
    return OSError(err, msg)


cdef class Segment:
    """A mapped POSIX shared-memory segment (``/dev/shm/<name>``)."""

    def __cinit__(self):
        self.addr = NULL
        self.size = 0
        self.exports = 0

    @staticmethod
    def create(str name, Py_ssize_t size):
        """Create and map a new segment of ``size`` bytes, mode 0600."""
        if size <= 0:
            raise ValueError("segment size must be positive, got %d" % size)
        cdef Segment self = Segment.__new__(Segment)
        cdef bytes bname = ("/" + name).encode()
        cdef int fd = shm_open(bname, O_CREAT | O_EXCL | O_RDWR, 0o600)
        if fd < 0:
            raise _os_error(errno, "cannot create shared memory segment", name)
        cdef void *p
        try:
            if ftruncate(fd, size) != 0:
                err = errno
                shm_unlink(bname)
                raise _os_error(err, "cannot size shared memory segment", name)
            p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if p == MAP_FAILED:
                err = errno
                shm_unlink(bname)
                raise _os_error(err, "cannot map shared memory segment", name)
        finally:
            c_close(fd)
        self.addr = <char *>p
        self.size = size
        self.name = name
        self.owner = True
        return self

    @staticmethod
    def attach(str name):
        """Map an existing segment; raises FileNotFoundError if it is gone."""
        cdef Segment self = Segment.__new__(Segment)
        cdef bytes bname = ("/" + name).encode()
        cdef int fd = shm_open(bname, O_RDWR, 0)
        if fd < 0:
            raise _os_error(errno, "cannot open shared memory segment", name)
        cdef struct_stat st
        cdef void *p
        try:
            if fstat(fd, &st) != 0:
                raise _os_error(errno, "cannot stat shared memory segment", name)
            if st.st_size <= 0:
                raise ValueError("shared memory segment %r is empty" % name)
            p = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if p == MAP_FAILED:
                raise _os_error(errno, "cannot map shared memory segment", name)
        finally:
            c_close(fd)
        self.addr = <char *>p
        self.size = st.st_size
        self.name = name
        self.owner = False
        return self

    @property
    def address(self):
        """Base address of the mapping (0 once unmapped)."""
        return <size_t>self.addr

    @property
    def closed(self):
        return self.addr == NULL or self.close_pending

    def unlink(self):
        """Remove the name from /dev/shm (mappings stay valid). Idempotent."""
        if self.unlinked:
            return
        self.unlinked = True
        cdef bytes bname = ("/" + self.name).encode()
        if shm_unlink(bname) != 0 and errno != ENOENT:
            raise _os_error(errno, "cannot unlink shared memory segment", self.name)

    def close(self):
        """Unmap now, or as soon as the last exported buffer is released."""
        if self.exports > 0:
            self.close_pending = True
        else:
            self._unmap()

    cdef int _unmap(self) except -1:
        if self.addr != NULL:
            munmap(self.addr, self.size)
            self.addr = NULL
        return 0

    def __getbuffer__(self, Py_buffer *view, int flags):
        if self.addr == NULL or self.close_pending:
            raise ValueError("shared memory segment %r is closed" % self.name)
        PyBuffer_FillInfo(view, self, self.addr, self.size, 0, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1
        if self.exports == 0 and self.close_pending:
            self._unmap()

    def __dealloc__(self):
        # Exports hold a reference to us, so at dealloc none is left.
        if self.addr != NULL:
            munmap(self.addr, self.size)
            self.addr = NULL

    def __repr__(self):
        return "<Segment %r size=%d owner=%s>" % (self.name, self.size, self.owner)
