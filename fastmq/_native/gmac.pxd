# Declarations of fmq_gmac.h (GMAC tags through the process's libcrypto).
cdef extern from "fmq_gmac.h":
    ctypedef void fmq_evp_ctx
    int FMQ_GMAC_KEY_BYTES
    int FMQ_GMAC_NONCE_BYTES
    int FMQ_GMAC_TAG_BYTES
    int fmq_gmac_load()
    fmq_evp_ctx *fmq_gmac_new(const unsigned char *key)
    void fmq_gmac_free(fmq_evp_ctx *ctx)
    int fmq_gmac_tag(fmq_evp_ctx *ctx, const unsigned char *nonce,
                     const unsigned char *const *parts, const size_t *lens, int n,
                     unsigned char *tag)
    int fmq_gmac_equal(const unsigned char *a, const unsigned char *b)
