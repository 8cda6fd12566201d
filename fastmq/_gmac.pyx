"""GMAC tags for the remote path's small parts, through the process's
libcrypto (OpenSSL) with the key's state kept.

A tag is GCM's with the bytes as associated data, nonce = seal counter
(u64) and index (u32), little-endian: identical to `cryptography`'s
``AESGCM(key).encrypt(nonce, b"", data)``.  Why not only `cryptography`:
it sets up a cipher context, key schedule included, on every call, which
is most of a small tag's cost; a kept context makes a small tag the GHASH
of its bytes and one AES block.  Large parts go through `cryptography`
(``fastmq._seal``), which lets go of the GIL.

The cipher itself is OpenSSL's (``fastmq/_native/fmq_gmac.h`` loads the
library at run time); fastmq holds no cipher code of its own.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from fastmq._native.gmac cimport (FMQ_GMAC_KEY_BYTES, FMQ_GMAC_TAG_BYTES, fmq_evp_ctx,
                                  fmq_gmac_equal, fmq_gmac_free, fmq_gmac_load, fmq_gmac_new,
                                  fmq_gmac_tag)

cdef enum:
    INLINE_PARTS = 8


def available():
    """Whether a ``Gmac`` can be made here (a libcrypto loads)."""
    return fmq_gmac_load() == 0


cdef class Gmac:
    """``Gmac(key)``: tags under one 32-byte AES-256 key.  Not for two
    threads at once (the caller holds the GIL)."""

    cdef fmq_evp_ctx *ctx

    def __cinit__(self, bytes key not None):
        if len(key) != FMQ_GMAC_KEY_BYTES:
            raise ValueError(f"Gmac: the key must be {FMQ_GMAC_KEY_BYTES} bytes, got {len(key)}")
        if fmq_gmac_load() != 0:
            raise RuntimeError("Gmac: no libcrypto (OpenSSL 1.1 or 3) could be loaded")
        self.ctx = fmq_gmac_new(<const unsigned char *>PyBytes_AS_STRING(key))
        if self.ctx == NULL:
            raise MemoryError("Gmac: libcrypto could not set up an AES-256-GCM context")

    def __dealloc__(self):
        fmq_gmac_free(self.ctx)
        self.ctx = NULL

    cdef int _tag(self, uint64_t counter, uint32_t index, parts, unsigned char *out) except -1:
        cdef Py_ssize_t n = len(parts), i, got = 0
        cdef unsigned char nonce[12]
        cdef Py_buffer inline_views[INLINE_PARTS]
        cdef const unsigned char *inline_ptrs[INLINE_PARTS]
        cdef size_t inline_lens[INLINE_PARTS]
        cdef Py_buffer *views = inline_views
        cdef const unsigned char **ptrs = inline_ptrs
        cdef size_t *lens = inline_lens
        cdef int rc = -1
        if n > INLINE_PARTS:
            views = <Py_buffer *>malloc(n * sizeof(Py_buffer))
            ptrs = <const unsigned char **>malloc(n * sizeof(void *))
            lens = <size_t *>malloc(n * sizeof(size_t))
            if views == NULL or ptrs == NULL or lens == NULL:
                free(views); free(ptrs); free(lens)
                raise MemoryError()
        for i in range(8):
            nonce[i] = (counter >> (8 * i)) & 0xFF
        for i in range(4):
            nonce[8 + i] = (index >> (8 * i)) & 0xFF
        try:
            for i in range(n):
                PyObject_GetBuffer(parts[i], &views[i], PyBUF_SIMPLE)
                got += 1
                ptrs[i] = <const unsigned char *>views[i].buf
                lens[i] = <size_t>views[i].len
            rc = fmq_gmac_tag(self.ctx, nonce, ptrs, lens, <int>n, out)
        finally:
            for i in range(got):
                PyBuffer_Release(&views[i])
            if n > INLINE_PARTS:
                free(views); free(ptrs); free(lens)
        if rc != 0:
            raise RuntimeError("Gmac: libcrypto failed to compute a tag")
        return 0

    def tag(self, uint64_t counter, uint32_t index, parts):
        """The 16-byte tag over ``parts`` (buffers) taken as one string."""
        out = PyBytes_FromStringAndSize(NULL, FMQ_GMAC_TAG_BYTES)
        self._tag(counter, index, parts, <unsigned char *>PyBytes_AS_STRING(out))
        return out

    def check(self, uint64_t counter, uint32_t index, parts, tag):
        """Whether ``tag`` (16 bytes) is the tag over ``parts``."""
        cdef unsigned char mine[16]
        cdef Py_buffer t
        PyObject_GetBuffer(tag, &t, PyBUF_SIMPLE)
        try:
            if t.len != FMQ_GMAC_TAG_BYTES:
                return False
            self._tag(counter, index, parts, mine)
            return bool(fmq_gmac_equal(mine, <const unsigned char *>t.buf))
        finally:
            PyBuffer_Release(&t)
