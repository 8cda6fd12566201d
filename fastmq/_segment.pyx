# cython: freethreading_compatible = False
"""POSIX shared-memory segments, owned by a ``cdef class``.

We map segments ourselves (``shm_open`` + ``mmap``) rather than through
``multiprocessing.shared_memory`` because:

* segments are created owner-only (``0600``) and exclusively (``O_EXCL``), so
  a name collision or a hostile pre-created file is an error, not a takeover;
* the resource tracker stays out of it: only the creator unlinks;
* the creator keeps the file descriptor, so that it can reserve pages
  (``reserve``) before it writes into them: a write into a never-touched
  page of a full tmpfs is a SIGBUS, a failed ``posix_fallocate`` is an
  exception;
* the mapping's lifetime follows the buffers exported from it.  A tensor
  viewing an arena slot holds a buffer export on this object, and
  ``close()`` while exports are alive defers the ``munmap`` to the moment the
  last export is released, so no view can ever point at unmapped memory.
"""
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo
from libc.errno cimport errno, EEXIST, ENOENT, ENOSPC
from libc.string cimport strerror
from posix.fcntl cimport O_CREAT, O_EXCL, O_RDWR
from posix.mman cimport (MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap,
                         munmap, shm_open, shm_unlink)
from posix.stat cimport fstat, struct_stat
from posix.unistd cimport close as c_close, ftruncate
from posix.types cimport off_t

cdef extern from "fcntl.h" nogil:
    int posix_fallocate(int fd, off_t offset, off_t length)

import os


SHM_DIR = "/dev/shm"


class ShmFullError(RuntimeError):
    """/dev/shm has no room for pages that fastmq was about to write.

    Raised instead of the SIGBUS that writing into an unbacked tmpfs page
    would deliver; nothing was written, and the same call works again once
    space is back."""


def shm_full_error(str what, Py_ssize_t needed, str name):
    mib = float(1 << 20)
    try:
        st = os.statvfs(SHM_DIR)
        size = "%.1f MiB, %.1f MiB free" % (st.f_blocks * st.f_frsize / mib,
                                             st.f_bavail * st.f_frsize / mib)
    except OSError:
        size = "size unknown"
    return ShmFullError(
        "%s is full (%s): %s needs %.1f MiB more in segment %r. Nothing was "
        "sent. Free space in %s or enlarge it (docker run --shm-size, or "
        "--ipc=host), then retry." % (SHM_DIR, size, what, needed / mib, name, SHM_DIR))


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
        self.fd = -1

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
        if ftruncate(fd, size) != 0:
            err = errno
            shm_unlink(bname)
            c_close(fd)
            raise _os_error(err, "cannot size shared memory segment", name)
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            err = errno
            shm_unlink(bname)
            c_close(fd)
            raise _os_error(err, "cannot map shared memory segment", name)
        self.fd = fd
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

    def reserve(self, Py_ssize_t offset, Py_ssize_t length, str what="this write"):
        """Allocate the pages of ``[offset, offset + length)`` in /dev/shm
        now, so that writing them later cannot fault.  Raises
        ``ShmFullError`` (naming ``what``) when /dev/shm is full, OSError on
        other failures; only the creator can reserve."""
        if offset < 0 or length < 0 or offset > self.size or length > self.size - offset:
            raise ValueError("reserve(%d, %d) outside segment %r of %d bytes"
                             % (offset, length, self.name, self.size))
        if self.fd < 0:
            raise ValueError("segment %r was not created by this end" % self.name)
        cdef int err
        with nogil:
            err = posix_fallocate(self.fd, offset, length)
        if err == ENOSPC:
            raise shm_full_error(what, length, self.name)
        if err != 0:
            raise _os_error(err, "cannot reserve pages of shared memory segment", self.name)

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
        if self.fd >= 0:
            c_close(self.fd)
            self.fd = -1
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
        if self.fd >= 0:
            c_close(self.fd)
            self.fd = -1
        if self.addr != NULL:
            munmap(self.addr, self.size)
            self.addr = NULL

    def __repr__(self):
        return "<Segment %r size=%d owner=%s>" % (self.name, self.size, self.owner)
