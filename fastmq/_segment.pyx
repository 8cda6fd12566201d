# cython: freethreading_compatible = False
"""Shared-memory segments: anonymous memory files, owned by a ``cdef class``.

Every ring and arena lives in a ``memfd_create`` file, never in ``/dev/shm``:

* nothing has a name a crash could leave behind.  The kernel frees the
  memory the moment the last descriptor and the last mapping of it are gone,
  however the processes holding them ended (``kill -9`` included);
* the file is sealed against growing and shrinking, so no holder can cut
  it under another's mapping (a truncated shared mapping is a SIGBUS);
* its size is not bounded by the ``/dev/shm`` mount (Docker's 64 MiB), only
  by memory; ``reserve`` allocates pages up front (``posix_fallocate``), so
  memory that cannot be had is an exception, not a fault mid-copy;
* a queue's local reader gets the creator's descriptor itself, passed
  over a unix socket (``fastmq._door``, ``SCM_RIGHTS``), and lends it to
  this module (``lend_descriptor``) before it attaches; any other opener
  goes through ``/proc/<creator pid>/fd/<fd>``, which the kernel allows
  only to a process that may inspect the creator (same user, creator
  dumpable, no fewer capabilities).  The locator a handle carries also
  names the file's inode, which the opener checks, so a reused pid or
  descriptor number is refused rather than mapped; and the file must be
  sealed against shrinking and growing, so that no holder can cut it under
  this mapping;
* the mapping's lifetime follows the buffers exported from it.  A tensor
  viewing an arena slot holds a buffer export on this object, and
  ``close()`` while exports are alive defers the ``munmap`` to the moment the
  last export is released, so no view can ever point at unmapped memory.
"""
from cpython.buffer cimport PyBuffer_FillInfo
from libc.errno cimport errno, EACCES, ENOENT, ENOMEM, ENOSPC, EPERM
from libc.string cimport strerror
from posix.fcntl cimport O_CLOEXEC, O_RDONLY, O_RDWR, open as c_open
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap
from posix.stat cimport fstat, struct_stat
from posix.unistd cimport close as c_close, ftruncate
from posix.types cimport off_t

from fastmq._memory cimport check_memory as _check_memory, segment_closed, segment_opened

cdef extern from "fmq_populate.h" nogil:
    int fmq_populate(char *p, size_t n)
    int fmq_have_populate()

cdef extern from "fcntl.h" nogil:
    int posix_fallocate(int fd, off_t offset, off_t length)
    int fcntl(int fd, int cmd, ...)
    enum:
        F_ADD_SEALS
        F_GET_SEALS
        F_SEAL_SEAL
        F_SEAL_SHRINK
        F_SEAL_GROW

cdef extern from "sys/mman.h" nogil:
    int memfd_create(const char *name, unsigned int flags)
    enum:
        MFD_CLOEXEC
        MFD_ALLOW_SEALING

import os


# The memory check before pages are allocated lives in fastmq._memory; these
# names stay importable from here.
from fastmq._memory import ShmFullError, memory_available, shm_full_error


cdef object _os_error(int err, str what, str name):
    msg = "%s %r: %s" % (what, name, strerror(err).decode())
    if err == ENOENT:
        return FileNotFoundError(err, msg)
    if err == EACCES or err == EPERM:
        return PermissionError(err, msg)
    return OSError(err, msg)


def parse_locator(str locator):
    """``(name, creator pid, fd, inode)`` of a locator
    ``fastmq_<pid>_<kind>_<hex>:<fd>:<inode>``; ValueError if it is not one."""
    try:
        name, fd, ino = locator.rsplit(":", 2)
        pid = int(name.split("_")[1])
        fd_n, ino_n = int(fd), int(ino)
    except (ValueError, IndexError):
        raise ValueError("%r is not a fastmq segment locator "
                         "(fastmq_<pid>_<kind>_<id>:<fd>:<inode>)" % (locator,)) from None
    if not name.startswith("fastmq_") or pid <= 0 or fd_n < 0 or ino_n <= 0:
        raise ValueError("%r is not a fastmq segment locator" % (locator,))
    return name, pid, fd_n, ino_n


# Descriptors a local reader received from its writer (fastmq._door), by
# segment name, until open_locator takes them: several readers of one queue
# in one process each lend their own copy of the same file.
_lent = {}


def lend_descriptor(str name, int fd):
    """Make ``fd`` (this process's descriptor of segment ``name``) the one
    the next attach of ``name`` uses instead of ``/proc``; the attach takes
    it over (and closes it)."""
    _lent.setdefault(name, []).append(fd)


def reclaim_descriptor(str name, int fd):
    """Close ``fd`` if it is still lent (its segment was never attached)."""
    fds = _lent.get(name)
    if fds is not None and fd in fds:
        fds.remove(fd)
        if not fds:
            del _lent[name]
        os.close(fd)


cdef int _take_lent(str name):
    fds = _lent.get(name)
    if not fds:
        return -1
    fd = fds.pop()
    if not fds:
        del _lent[name]
    return fd


cdef object _proc_open_error(int err, str name, int pid, bytes path):
    """Why ``/proc/<pid>/fd/<n>`` could not be opened, naming the cause this
    process can see (another uid, a creator that is not dumpable,
    capabilities this process lacks, ``hidepid``, another pid namespace),
    and what to do."""
    fix = ("A queue's readers get its segments from the writer itself, through "
           "its segment door, which needs no such access (a handle without a "
           "door comes from an older fastmq: run the same fastmq everywhere)")
    if err == ENOENT:
        if os.path.exists("/proc/%d" % pid):
            return FileNotFoundError(
                err, "fastmq segment %r is gone: its creator (pid %d) closed it" % (name, pid))
        why = []
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) > 4 and fields[4] == "/proc" and "-" in fields:
                        sep = fields.index("-")
                        for opt in (fields[sep + 3].split(",") if len(fields) > sep + 3
                                    else ()):
                            if opt.startswith("hidepid=") and opt[8:] not in ("0", "off"):
                                why = ["/proc is mounted with %s, which hides other users' "
                                       "processes from this one" % opt]
        except (OSError, ValueError):
            pass
        # Another pid namespace than the host's: its /proc's NSpid line has
        # more than one pid when that /proc is the parent's; with a /proc of
        # its own, the namespace is not the initial one (whose inode number
        # is fixed, PROC_PID_INIT_INO).
        nested = False
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("NSpid:") and len(line.split()) > 2:
                        nested = True
            if os.stat("/proc/self/ns/pid").st_ino != 0xEFFFFFFC:
                nested = True
        except OSError:
            pass
        if nested:
            why.append("this process is in a pid namespace of its own (not the host's), "
                       "whose /proc does not show processes outside it")
        return FileNotFoundError(
            err, "fastmq segment %r cannot be found through %s: its creator (pid %d) "
            "exited, or is not visible from this process (%s). %s"
            % (name, path.decode(), pid,
               "; ".join(why) or "another pid namespace or host, or /proc mounted "
               "with hidepid", fix))
    if err == EACCES or err == EPERM:
        theirs = {}
        mine = {}
        for who, into in (("%d" % pid, theirs), ("self", mine)):
            try:
                with open("/proc/%s/status" % who) as f:
                    for line in f:
                        key, _, value = line.partition(":")
                        into[key] = value.split()
            except OSError:
                pass
        why = []
        try:
            my_caps = int(mine["CapEff"][0], 16)
            my_fsuid = int(mine["Uid"][3])
            their_uids = [int(u) for u in theirs["Uid"][:3]]
            their_caps = int(theirs["CapPrm"][0], 16)
        except (KeyError, IndexError, ValueError):
            pass
        else:
            if not my_caps & (1 << 19):       # CAP_SYS_PTRACE overrides the rest
                if any(u != my_fsuid for u in their_uids):
                    why.append("it runs as another user (uid %s) than this process (uid %d), "
                               "which lacks CAP_SYS_PTRACE"
                               % ("/".join(str(u) for u in sorted(set(their_uids))), my_fsuid))
                if their_caps & ~my_caps:
                    why.append("it holds capabilities this process lacks (its permitted "
                               "set %x, this process's effective set %x)"
                               % (their_caps, my_caps))
                try:
                    # (Its fd directory, not /proc/<pid>, which keeps the
                    # process's owner whatever its dumpable flag.)
                    owner = os.stat("/proc/%d/fd" % pid).st_uid
                except OSError:
                    owner = -1
                if owner == 0 and their_uids[1] != 0:
                    why.append("it is not dumpable (it changed its uid, ran a setuid program "
                               "or set PR_SET_DUMPABLE 0: its /proc/%d/fd belongs to root)"
                               % pid)
                elif not why:
                    why.append("it is not dumpable (it changed its uid, ran a setuid program "
                               "or set PR_SET_DUMPABLE 0), or a security module refuses")
        return PermissionError(
            err, "cannot open fastmq segment %r through %s: the kernel refuses this process "
            "ptrace access to its creator (pid %d): %s. %s; other tools need the creator's "
            "uid and CAP_SYS_PTRACE (root with it sees every segment)"
            % (name, path.decode(), pid,
               "; ".join(why) or "it runs as another user, is not dumpable (it changed its "
               "uid, ran a setuid program or set PR_SET_DUMPABLE 0), or has capabilities "
               "this process lacks", fix))
    return _os_error(err, "cannot open fastmq segment (through %s)" % path.decode(), name)


cdef int open_locator(str locator, bint writable, struct_stat *st) except -1:
    """Open the segment ``locator`` names (a descriptor lent by the writer
    (``lend_descriptor``), else through its creator's descriptor in
    ``/proc``) and check that it is that file, sealed.  Returns the
    descriptor (the caller closes it).  FileNotFoundError when the creator
    or its descriptor is gone (or this process cannot see it),
    PermissionError when the kernel does not let this process inspect the
    creator; both say why."""
    name, pid, fd_n, ino = parse_locator(locator)
    cdef bytes path = ("/proc/%d/fd/%d" % (pid, fd_n)).encode()
    cdef int fd = _take_lent(name)
    if fd < 0:
        fd = c_open(path, (O_RDWR if writable else O_RDONLY) | O_CLOEXEC)
        if fd < 0:
            raise _proc_open_error(errno, name, pid, path)
    if fstat(fd, st) != 0:
        err = errno
        c_close(fd)
        raise _os_error(err, "cannot stat fastmq segment", name)
    if <unsigned long long>st.st_ino != <unsigned long long>ino:
        c_close(fd)
        raise FileNotFoundError(
            ENOENT, "fastmq segment %r is gone: pid %d's descriptor %d is another file now "
            "(the creator exited and its pid or descriptor was reused)" % (name, pid, fd_n))
    cdef int seals = fcntl(fd, F_GET_SEALS)
    if seals < 0 or (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW):
        c_close(fd)
        raise PermissionError(
            EPERM, "fastmq segment %r is not sealed against shrinking and growing: it is "
            "not a fastmq segment, and mapping it could fault" % name)
    return fd


cdef class Segment:
    """A mapped shared-memory segment (an anonymous memory file)."""

    def __cinit__(self):
        self.addr = NULL
        self.size = 0
        self.exports = 0
        self.fd = -1
        self.inode = 0

    @staticmethod
    def create(str name, Py_ssize_t size):
        """Create and map a new segment of ``size`` bytes, sealed at that
        size.  ``name`` is what ``/proc/<pid>/fd`` shows (``memfd:<name>``)."""
        if size <= 0:
            raise ValueError("segment size must be positive, got %d" % size)
        cdef Segment self = Segment.__new__(Segment)
        cdef bytes bname = name.encode()
        cdef int fd = memfd_create(bname, MFD_CLOEXEC | MFD_ALLOW_SEALING)
        if fd < 0:
            raise _os_error(errno, "cannot create shared memory segment", name)
        cdef void *p
        cdef struct_stat st
        if (ftruncate(fd, size) != 0
                or fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0
                or fstat(fd, &st) != 0):
            err = errno
            c_close(fd)
            if err == ENOMEM or err == ENOSPC:
                raise shm_full_error("creating it", size, name)
            raise _os_error(err, "cannot size and seal shared memory segment", name)
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            err = errno
            c_close(fd)
            if err == ENOMEM:       # more address space than this process may have
                raise shm_full_error("mapping it", size, name)
            raise _os_error(err, "cannot map shared memory segment", name)
        self.fd = fd
        self.inode = st.st_ino
        self.addr = <char *>p
        self.size = size
        self.name = name
        self.owner = True
        self.mapped()
        return self

    @staticmethod
    def attach(str locator, bint writable=True):
        """Map the segment ``locator`` names (``Segment.locator`` on its
        creator's side).  FileNotFoundError if it is gone; see
        ``open_locator`` for the other failures."""
        cdef struct_stat st
        cdef int fd = open_locator(locator, writable, &st)
        cdef Segment self = Segment.__new__(Segment)
        cdef void *p
        try:
            if st.st_size <= 0:
                raise ValueError("shared memory segment %r is empty" % locator)
            p = mmap(NULL, st.st_size, PROT_READ | (PROT_WRITE if writable else 0),
                     MAP_SHARED, fd, 0)
            if p == MAP_FAILED:
                raise _os_error(errno, "cannot map shared memory segment", locator)
        finally:
            c_close(fd)
        self.addr = <char *>p
        self.size = st.st_size
        self.name = parse_locator(locator)[0]
        self.inode = st.st_ino
        self.owner = False
        self.readonly = not writable
        self.mapped()
        return self

    @property
    def locator(self):
        """What another process passes to ``attach``: the name, the
        creator's descriptor and the file's inode."""
        if self.fd < 0:
            raise ValueError("segment %r was not created by this process, or is closed"
                             % self.name)
        return "%s:%d:%d" % (self.name, self.fd, self.inode)

    def reserve(self, Py_ssize_t offset, Py_ssize_t length, str what="this write",
                Py_ssize_t check=-1):
        """Allocate the pages of ``[offset, offset + length)`` now, so that
        writing them later cannot fault.  Raises ``ShmFullError`` (naming
        ``what``) when the memory cannot be had, OSError on other failures;
        only the creator can reserve.  ``check``: the bytes the host is
        asked to have first (``length`` by default; 0 where the caller
        asked for this range already, with a larger one)."""
        if offset < 0 or length < 0 or offset > self.size or length > self.size - offset:
            raise ValueError("reserve(%d, %d) outside segment %r of %d bytes"
                             % (offset, length, self.name, self.size))
        if self.fd < 0:
            raise ValueError("segment %r was not created by this end" % self.name)
        _check_memory(what, length if check < 0 else check, self.name)
        cdef int err
        with nogil:
            err = posix_fallocate(self.fd, offset, length)
        if err == ENOSPC or err == ENOMEM:
            raise shm_full_error(what, length, self.name)
        if err != 0:
            raise _os_error(err, "cannot reserve pages of shared memory segment", self.name)

    def populate(self, Py_ssize_t offset, Py_ssize_t length, str what="this write",
                 Py_ssize_t check=-1):
        """``reserve``, and map the pages into this process too, in one call
        (``MADV_POPULATE_WRITE``, Linux 5.14; ``reserve`` alone before): a
        copy into the range then takes no page fault per 4 KiB.  ``check``
        as for ``reserve``."""
        if offset < 0 or length < 0 or offset > self.size or length > self.size - offset:
            raise ValueError("populate(%d, %d) outside segment %r of %d bytes"
                             % (offset, length, self.name, self.size))
        if self.fd < 0 or self.readonly or not fmq_have_populate():
            return self.reserve(offset, length, what, check)
        # A memory file has no size limit of its own: populating past what
        # the host has left would wake the OOM killer, so asked first.
        _check_memory(what, length if check < 0 else check, self.name)
        cdef int err
        with nogil:
            err = fmq_populate(self.addr + offset, length)
        if err != 0:        # the same range through posix_fallocate: its error
            self.reserve(offset, length, what)

    def held_bytes(self):
        """Bytes of memory the segment holds now (its allocated pages, shared
        by every process that maps it); creator only."""
        if self.fd < 0:
            raise ValueError("segment %r was not created by this end" % self.name)
        cdef struct_stat st
        if fstat(self.fd, &st) != 0:
            raise _os_error(errno, "cannot stat shared memory segment", self.name)
        return st.st_blocks * 512

    @property
    def address(self):
        """Base address of the mapping (0 once unmapped)."""
        return <size_t>self.addr

    @property
    def closed(self):
        return self.addr == NULL or self.close_pending

    def drop_descriptor(self):
        """Close the creator's descriptor, keeping the mapping: for a forked
        child, whose inherited copy would keep the memory alive for as long
        as it runs but which never lets another process attach."""
        if self.fd >= 0:
            c_close(self.fd)
            self.fd = -1

    def close(self):
        """Unmap now, or as soon as the last exported buffer is released."""
        if self.exports > 0:
            self.close_pending = True
            # The descriptor goes now: no process can attach any more.
            self.drop_descriptor()
        else:
            self._unmap()

    cdef int _unmap(self) except -1:
        if self.fd >= 0:
            c_close(self.fd)
            self.fd = -1
        if self.addr != NULL:
            munmap(self.addr, self.size)
            self.addr = NULL
        if self.counted:
            self.counted = False
            segment_closed()
        return 0

    cdef int mapped(self) except -1:
        # Once per mapping, however it was made (an arena reader maps its
        # segment itself): the count and _unmap() stay paired.
        if not self.counted:
            self.counted = True
            segment_opened()
        return 0

    def __getbuffer__(self, Py_buffer *view, int flags):
        if self.addr == NULL or self.close_pending:
            raise ValueError("shared memory segment %r is closed" % self.name)
        PyBuffer_FillInfo(view, self, self.addr, self.size, self.readonly, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1
        if self.exports == 0 and self.close_pending:
            self._unmap()

    def __dealloc__(self):
        # Exports hold a reference to us, so at dealloc none is left.
        self._unmap()

    def __repr__(self):
        return "<Segment %r size=%d owner=%s>" % (self.name, self.size, self.owner)
