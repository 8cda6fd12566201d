# What every fastmq segment layout shares (the ring, the tensor arena): one
# definition of the word accessors, the alignment rule and the header
# check, cimported by the ring's modules (fastmq/_ring*.pyx) and
# fastmq/_arena.pyx.  Each layout's own offsets stay with it
# (fastmq/_ring_layout.pxd, fastmq/_arena.pyx).
from libc.stdint cimport uint32_t, uint64_t

from fastmq._native.atomic cimport fmq_load_u64_acq

# Every fastmq segment header begins with these two words.
cdef enum:
    SEG_MAGIC = 0       # u64, stored last by the creator (release)
    SEG_VERSION = 8     # u32 layout version

# header_status() results.
cdef enum:
    HEADER_OK = 0
    HEADER_NO_MAGIC = 1
    HEADER_BAD_VERSION = 2


cdef inline Py_ssize_t align_up(Py_ssize_t n, Py_ssize_t a) noexcept nogil:
    """``n`` rounded up to a multiple of ``a`` (a power of two)."""
    return (n + a - 1) & ~(a - 1)


cdef inline uint32_t *word32(char *base, Py_ssize_t off) noexcept nogil:
    return <uint32_t *>(base + off)


cdef inline uint64_t *word64(char *base, Py_ssize_t off) noexcept nogil:
    return <uint64_t *>(base + off)


cdef inline int header_status(char *base, uint64_t magic, uint32_t version) noexcept nogil:
    """Whether the header at ``base`` is a finished header of this kind and
    layout version.  The magic is read with acquire: it is published last,
    so every other header field is visible once it is seen.  Each caller
    raises its own error (ring and arena errors differ) and then checks
    its geometry against its handle."""
    if fmq_load_u64_acq(word64(base, SEG_MAGIC)) != magic:
        return HEADER_NO_MAGIC
    if word32(base, SEG_VERSION)[0] != version:
        return HEADER_BAD_VERSION
    return HEADER_OK
