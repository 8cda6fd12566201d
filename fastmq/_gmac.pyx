"""GMAC tags for the remote path, with the key's state kept per key.

Two engines compute the same tags (GCM with the bytes as associated data,
nonce = sequence number (u64) and index (u32), little-endian), identical
to `cryptography`'s ``AESGCM(key).encrypt(nonce, b"", data)``:

* ``"cpu"``: the CPU's AES and carry-less multiply instructions
  (``fastmq/_native/fmq_aesgmac.h``; x86-64 with AES-NI and PCLMULQDQ, and
  an AVX-512 loop for long runs where the CPU has VPCLMULQDQ), the default
  where it can run: tens of nanoseconds a call, and long runs without the
  GIL;
* ``"libcrypto"``: the process's libcrypto loaded at run time
  (``fastmq/_native/fmq_gmac.h``), with one cipher context per key.

``fastmq._seal`` uses a ``Gmac`` where ``available()`` says one of them
runs, and the ``cryptography`` package otherwise.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from fastmq._native.gmac cimport (FMQ_GMAC_KEY_BYTES, FMQ_GMAC_NONCE_BYTES, FMQ_GMAC_TAG_BYTES,
                                  fmq_aesgmac, fmq_aesgmac_cpu, fmq_aesgmac_free,
                                  fmq_aesgmac_narrow, fmq_aesgmac_new, fmq_aesgmac_wide, fmq_ag_tag, fmq_evp_ctx,
                                  fmq_gmac_equal, fmq_gmac_free, fmq_gmac_load, fmq_gmac_new,
                                  fmq_gmac_tag)

cdef enum:
    INLINE_PARTS = 8
    # ("cpu") Tags over this many bytes or more are computed without the GIL.
    NOGIL_BYTES = 256 * 1024


def available():
    """Whether a ``Gmac`` can be made here (either engine)."""
    return bool(fmq_aesgmac_cpu()) or fmq_gmac_load() == 0


def engines():
    """The engines that run here, preferred first."""
    out = []
    if fmq_aesgmac_cpu():
        out.append("cpu")
    if fmq_gmac_load() == 0:
        out.append("libcrypto")
    return out


cdef class Gmac:
    """``Gmac(key, engine=None, wide=True)``: tags under one 32-byte AES-256
    key; ``engine`` is ``"cpu"`` or ``"libcrypto"`` (default: the first of
    ``engines()``); ``wide=False`` keeps the ``"cpu"`` engine off its
    AVX-512 loop (``wide`` says whether it runs it)."""

    cdef fmq_evp_ctx *ctx
    cdef fmq_aesgmac *cpu
    cdef readonly str engine
    cdef readonly bint wide

    def __cinit__(self, bytes key not None, engine=None, bint wide=True):
        if len(key) != FMQ_GMAC_KEY_BYTES:
            raise ValueError(f"Gmac: the key must be {FMQ_GMAC_KEY_BYTES} bytes, got {len(key)}")
        here = engines()
        if engine is None:
            if not here:
                raise RuntimeError("Gmac: this CPU has no AES/carry-less multiply instructions "
                                   "and no libcrypto (OpenSSL 1.1 or 3) could be loaded")
            engine = here[0]
        elif engine not in ("cpu", "libcrypto"):
            raise ValueError(f"Gmac: engine {engine!r} is not 'cpu' or 'libcrypto'")
        elif engine not in here:
            raise RuntimeError(f"Gmac: engine {engine!r} does not run here")
        self.engine = engine
        if engine == "cpu":
            self.cpu = fmq_aesgmac_new(<const unsigned char *>PyBytes_AS_STRING(key))
            if self.cpu == NULL:
                raise MemoryError("Gmac: no memory for the key's state")
            if not wide:
                fmq_aesgmac_narrow(self.cpu)
            self.wide = fmq_aesgmac_wide(self.cpu)
        else:
            self.ctx = fmq_gmac_new(<const unsigned char *>PyBytes_AS_STRING(key))
            if self.ctx == NULL:
                raise MemoryError("Gmac: libcrypto could not set up an AES-256-GCM context")

    def __dealloc__(self):
        fmq_aesgmac_free(self.cpu)
        self.cpu = NULL
        fmq_gmac_free(self.ctx)
        self.ctx = NULL

    cdef int _tag(self, uint64_t seq, uint32_t index, parts, unsigned char *out) except -1:
        cdef Py_ssize_t n = len(parts), i, got = 0
        cdef unsigned char nonce[12]
        cdef Py_buffer inline_views[INLINE_PARTS]
        cdef const unsigned char *inline_ptrs[INLINE_PARTS]
        cdef size_t inline_lens[INLINE_PARTS]
        cdef Py_buffer *views = inline_views
        cdef const unsigned char **ptrs = inline_ptrs
        cdef size_t *lens = inline_lens
        cdef int rc
        cdef size_t total = 0
        if n > INLINE_PARTS:
            views = <Py_buffer *>malloc(n * sizeof(Py_buffer))
            ptrs = <const unsigned char **>malloc(n * sizeof(void *))
            lens = <size_t *>malloc(n * sizeof(size_t))
            if views == NULL or ptrs == NULL or lens == NULL:
                free(views); free(ptrs); free(lens)
                raise MemoryError()
        for i in range(8):
            nonce[i] = (seq >> (8 * i)) & 0xFF
        for i in range(4):
            nonce[8 + i] = (index >> (8 * i)) & 0xFF
        try:
            for i in range(n):
                PyObject_GetBuffer(parts[i], &views[i], PyBUF_SIMPLE)
                got += 1
                ptrs[i] = <const unsigned char *>views[i].buf
                lens[i] = <size_t>views[i].len
                total += lens[i]
            if self.cpu != NULL:
                # The key's state is only read: other threads may tag at
                # once; the views hold the buffers while the GIL is let go.
                rc = 0
                if total >= NOGIL_BYTES:
                    with nogil:
                        fmq_ag_tag(self.cpu, nonce, ptrs, lens, <int>n, out)
                else:
                    fmq_ag_tag(self.cpu, nonce, ptrs, lens, <int>n, out)
            else:
                # A kept EVP context is not for two threads at once: the
                # GIL stays held.
                rc = fmq_gmac_tag(self.ctx, nonce, ptrs, lens, <int>n, out)
        finally:
            for i in range(got):
                PyBuffer_Release(&views[i])
            if n > INLINE_PARTS:
                free(views); free(ptrs); free(lens)
        if rc != 0:
            raise RuntimeError("Gmac: libcrypto failed to compute a tag")
        return 0

    def tag(self, uint64_t seq, uint32_t index, parts):
        """The 16-byte tag over ``parts`` (buffers) taken as one string."""
        out = PyBytes_FromStringAndSize(NULL, FMQ_GMAC_TAG_BYTES)
        self._tag(seq, index, parts, <unsigned char *>PyBytes_AS_STRING(out))
        return out

    def check(self, uint64_t seq, uint32_t index, parts, tag):
        """Whether ``tag`` (16 bytes) is the tag over ``parts``."""
        cdef unsigned char mine[16]
        cdef Py_buffer t
        PyObject_GetBuffer(tag, &t, PyBUF_SIMPLE)
        try:
            if t.len != FMQ_GMAC_TAG_BYTES:
                return False
            self._tag(seq, index, parts, mine)
            return bool(fmq_gmac_equal(mine, <const unsigned char *>t.buf))
        finally:
            PyBuffer_Release(&t)
