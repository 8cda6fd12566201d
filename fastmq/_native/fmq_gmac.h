/* GMAC (AES-256-GCM over associated data only) through the process's
 * libcrypto, loaded at run time.
 *
 * Why: a small message's tag through the `cryptography` package costs
 * about three quarters of a microsecond, most of it setting up a cipher
 * context (key schedule included) for every call; with one context per
 * key, kept, a tag is the GHASH of the bytes plus one AES block, a few
 * tenths of a microsecond.  The tags are GCM's, identical to
 * `cryptography`'s AESGCM(key).encrypt(nonce, b"", data), so either end
 * may compute them either way.
 *
 * Why loaded at run time and not linked: building fastmq then needs no
 * OpenSSL headers, and a Python built against its own libcrypto (pyenv,
 * conda) shares the one its hashlib already loaded (dlopen by soname
 * returns the loaded copy).  Only functions whose ABI is the same in
 * OpenSSL 1.1 and 3.x are used.  Where none loads, fmq_gmac_load() fails
 * and fastmq keeps using `cryptography` for every tag.
 *
 * A context is used by one thread at a time (the caller holds the GIL). */
#ifndef FMQ_GMAC_H
#define FMQ_GMAC_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FMQ_GMAC_KEY_BYTES 32
#define FMQ_GMAC_NONCE_BYTES 12
#define FMQ_GMAC_TAG_BYTES 16

/* OpenSSL's values (evp.h); stable since 1.1. */
#define FMQ_EVP_CTRL_GCM_GET_TAG 0x10

typedef void fmq_evp_ctx;
typedef void fmq_evp_cipher;

static struct {
    int loaded;   /* 1 ok, -1 failed, 0 not tried */
    fmq_evp_ctx *(*ctx_new)(void);
    void (*ctx_free)(fmq_evp_ctx *);
    const fmq_evp_cipher *(*aes_256_gcm)(void);
    int (*init)(fmq_evp_ctx *, const fmq_evp_cipher *, void *, const unsigned char *,
                const unsigned char *);
    int (*update)(fmq_evp_ctx *, unsigned char *, int *, const unsigned char *, int);
    int (*final)(fmq_evp_ctx *, unsigned char *, int *);
    int (*ctrl)(fmq_evp_ctx *, int, int, void *);
} fmq_crypto;

/* 0 once libcrypto's functions are resolved, -1 if they cannot be. */
static int fmq_gmac_load(void) {
    static const char *names[] = {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so", NULL};
    void *lib = NULL;
    if (fmq_crypto.loaded)
        return fmq_crypto.loaded > 0 ? 0 : -1;
    fmq_crypto.loaded = -1;
    for (int i = 0; names[i] && !lib; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return -1;
    *(void **)&fmq_crypto.ctx_new = dlsym(lib, "EVP_CIPHER_CTX_new");
    *(void **)&fmq_crypto.ctx_free = dlsym(lib, "EVP_CIPHER_CTX_free");
    *(void **)&fmq_crypto.aes_256_gcm = dlsym(lib, "EVP_aes_256_gcm");
    *(void **)&fmq_crypto.init = dlsym(lib, "EVP_EncryptInit_ex");
    *(void **)&fmq_crypto.update = dlsym(lib, "EVP_EncryptUpdate");
    *(void **)&fmq_crypto.final = dlsym(lib, "EVP_EncryptFinal_ex");
    *(void **)&fmq_crypto.ctrl = dlsym(lib, "EVP_CIPHER_CTX_ctrl");
    if (!fmq_crypto.ctx_new || !fmq_crypto.ctx_free || !fmq_crypto.aes_256_gcm ||
        !fmq_crypto.init || !fmq_crypto.update || !fmq_crypto.final || !fmq_crypto.ctrl)
        return -1;   /* the library stays loaded: unloading what hashlib may share is unsafe */
    fmq_crypto.loaded = 1;
    return 0;
}

/* A context keyed once (the AES key schedule is computed here, not per tag). */
static fmq_evp_ctx *fmq_gmac_new(const unsigned char key[FMQ_GMAC_KEY_BYTES]) {
    fmq_evp_ctx *ctx = fmq_crypto.ctx_new();
    if (!ctx)
        return NULL;
    if (fmq_crypto.init(ctx, fmq_crypto.aes_256_gcm(), NULL, key, NULL) != 1) {
        fmq_crypto.ctx_free(ctx);
        return NULL;
    }
    return ctx;
}

static void fmq_gmac_free(fmq_evp_ctx *ctx) {
    if (ctx)
        fmq_crypto.ctx_free(ctx);
}

/* The tag over parts[0..n) taken as one string (GCM's associated data may
 * come in pieces: no copy to join them).  0 on success. */
static int fmq_gmac_tag(fmq_evp_ctx *ctx, const unsigned char nonce[FMQ_GMAC_NONCE_BYTES],
                        const unsigned char *const *parts, const size_t *lens, int n,
                        unsigned char tag[FMQ_GMAC_TAG_BYTES]) {
    int outl;
    unsigned char none[FMQ_GMAC_TAG_BYTES];   /* GCM's final writes no bytes; a place anyway */
    if (fmq_crypto.init(ctx, NULL, NULL, NULL, nonce) != 1)
        return -1;
    for (int i = 0; i < n; i++) {
        size_t left = lens[i];
        const unsigned char *p = parts[i];
        while (left) {   /* EVP lengths are ints */
            int step = left > (1u << 30) ? (1 << 30) : (int)left;
            if (fmq_crypto.update(ctx, NULL, &outl, p, step) != 1)
                return -1;
            p += step;
            left -= (size_t)step;
        }
    }
    if (fmq_crypto.final(ctx, none, &outl) != 1)
        return -1;
    return fmq_crypto.ctrl(ctx, FMQ_EVP_CTRL_GCM_GET_TAG, FMQ_GMAC_TAG_BYTES, tag) == 1 ? 0 : -1;
}

/* Tag comparison in time independent of where they differ. */
static int fmq_gmac_equal(const unsigned char *a, const unsigned char *b) {
    unsigned char d = 0;
    for (int i = 0; i < FMQ_GMAC_TAG_BYTES; i++)
        d |= (unsigned char)(a[i] ^ b[i]);
    return d == 0;
}

#endif
