# Declarations of fmq_gmac.h (GMAC tags through the process's libcrypto)
# and fmq_aesgmac.h (GMAC tags on the CPU's AES and carry-less multiply).
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

cdef extern from "fmq_aesgmac.h":
    ctypedef struct fmq_aesgmac:
        pass
    int fmq_aesgmac_cpu()
    fmq_aesgmac *fmq_aesgmac_new(const unsigned char *key)
    void fmq_aesgmac_free(fmq_aesgmac *g)
    int fmq_aesgmac_wide(const fmq_aesgmac *g)
    void fmq_aesgmac_narrow(fmq_aesgmac *g)
    void fmq_ag_tag(const fmq_aesgmac *g, const unsigned char *nonce,
                    const unsigned char *const *parts, const size_t *lens, int n,
                    unsigned char *tag) nogil
