/* GMAC (AES-256-GCM over associated data only) on the CPU's own AES and
 * carry-less multiply instructions, x86-64 only.
 *
 * Why not libcrypto (fmq_gmac.h) here: a call through EVP costs about a
 * quarter of a microsecond before it hashes a byte, and twice that when
 * its code has left the cache between two messages, which is how a queue
 * calls it; the tag of a 1 KiB message is about 0.08 us here.  And the
 * wide loop (AVX-512 VPCLMULQDQ) hashes long runs at least as fast as the
 * OpenSSL that `cryptography` bundles, without the GIL.
 *
 * The tags are GCM's: identical to `cryptography`'s
 * AESGCM(key).encrypt(nonce, b"", data), so either end may compute them
 * either way (the tests compare them).  The functions carry their own
 * target attributes: the extension is built for the baseline CPU, and
 * fmq_aesgmac_cpu() says at run time whether they may be called.
 *
 * GHASH works here in the byte-reversed domain (each 16-byte block loaded
 * with its bytes reversed, as in Intel's carry-less multiplication paper):
 * a field product is then four 64x64 carry-less products, a shift left by
 * one and a reduction by x^128 + x^7 + x^2 + x + 1.  Shift and reduction
 * are linear, so the products of several blocks are summed first and
 * reduced once:
 *
 *     X' = (X + B0) H^k + B1 H^(k-1) + ... + B(k-1) H
 *
 * with k = 8 (128 bytes) on the 128-bit path and k = 64 (1 KiB) on the
 * wide one, whose power table is laid out as the blocks come:
 *
 *     hw[0] = | H^64 | H^63 | H^62 | H^61 |   (lanes 0..3 of one zmm)
 *     hw[1] = | H^60 | ...                |
 *     ...
 *     hw[15]= | H^4  | H^3  | H^2  | H^1  |
 *
 * and hk[] holds each power's halves xored, for Karatsuba's middle product.
 */
#ifndef FMQ_AESGMAC_H
#define FMQ_AESGMAC_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    _Alignas(64) uint8_t hw[16][64];   /* H^64 .. H^1, as drawn above */
    _Alignas(64) uint8_t hk[16][64];   /* the same, each power's halves xored */
    _Alignas(16) uint8_t rk[15][16];   /* AES-256 round keys */
    _Alignas(16) uint8_t hp[8][16];    /* H, H^2, ..., H^8 */
    int wide;                          /* the AVX-512 loop may run */
} fmq_aesgmac;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define FMQ_AG_T __attribute__((target("aes,pclmul,ssse3")))
#define FMQ_AG_T512 __attribute__((target("aes,pclmul,ssse3,avx512f,avx512bw,vpclmulqdq")))

/* 1 where the 128-bit path may run (AES-NI, PCLMULQDQ, SSSE3). */
static int fmq_aesgmac_cpu(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("aes") && __builtin_cpu_supports("pclmul") &&
           __builtin_cpu_supports("ssse3");
}

static int fmq_aesgmac_cpu_wide(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("vpclmulqdq");
}

FMQ_AG_T static inline __m128i fmq_ag_reverse(__m128i x) {
    return _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* a * b, carry-less, 256 bits as (lo, hi) */
FMQ_AG_T static inline void fmq_ag_clmul(__m128i a, __m128i b, __m128i *lo, __m128i *hi) {
    __m128i mid = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10),
                                _mm_clmulepi64_si128(a, b, 0x01));
    *lo = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x00), _mm_slli_si128(mid, 8));
    *hi = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x11), _mm_srli_si128(mid, 8));
}

/* (lo, hi) shifted left by one bit (the byte-reversed domain's bit order),
 * then reduced modulo GCM's polynomial: a field element */
FMQ_AG_T static inline __m128i fmq_ag_reduce(__m128i lo, __m128i hi) {
    __m128i carry_lo = _mm_srli_epi32(lo, 31), carry_hi = _mm_srli_epi32(hi, 31);
    lo = _mm_or_si128(_mm_slli_epi32(lo, 1), _mm_slli_si128(carry_lo, 4));
    hi = _mm_or_si128(_mm_slli_epi32(hi, 1), _mm_slli_si128(carry_hi, 4));
    hi = _mm_or_si128(hi, _mm_srli_si128(carry_lo, 12));
    /* fold the low half in twice: x^128 = x^7 + x^2 + x + 1 */
    __m128i a = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(lo, 31), _mm_slli_epi32(lo, 30)),
                              _mm_slli_epi32(lo, 25));
    lo = _mm_xor_si128(lo, _mm_slli_si128(a, 12));
    __m128i b = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(lo, 1), _mm_srli_epi32(lo, 2)),
                              _mm_srli_epi32(lo, 7));
    b = _mm_xor_si128(b, _mm_srli_si128(a, 4));
    return _mm_xor_si128(hi, _mm_xor_si128(lo, b));
}

FMQ_AG_T static inline __m128i fmq_ag_mul(__m128i a, __m128i b) {
    __m128i lo, hi;
    fmq_ag_clmul(a, b, &lo, &hi);
    return fmq_ag_reduce(lo, hi);
}

FMQ_AG_T static inline __m128i fmq_ag_load(const uint8_t *p) {
    return _mm_loadu_si128((const __m128i *)p);
}

/* AES-256 key expansion: the even round keys from the odd ones' last word
 * (RotWord, SubWord, round constant), the odd ones from the even ones'
 * (SubWord only) */
FMQ_AG_T static inline __m128i fmq_ag_spread(__m128i k) {
    k = _mm_xor_si128(k, _mm_slli_si128(k, 4));
    return _mm_xor_si128(k, _mm_slli_si128(k, 8));
}

#define FMQ_AG_EVEN(prev_even, odd, rcon)                                                    \
    _mm_xor_si128(fmq_ag_spread(prev_even),                                                  \
                  _mm_shuffle_epi32(_mm_aeskeygenassist_si128(odd, rcon), 0xff))
#define FMQ_AG_ODD(prev_odd, even)                                                           \
    _mm_xor_si128(fmq_ag_spread(prev_odd),                                                   \
                  _mm_shuffle_epi32(_mm_aeskeygenassist_si128(even, 0), 0xaa))

FMQ_AG_T static __m128i fmq_ag_aes(const fmq_aesgmac *g, __m128i x) {
    x = _mm_xor_si128(x, _mm_load_si128((const __m128i *)g->rk[0]));
    for (int i = 1; i < 14; i++)
        x = _mm_aesenc_si128(x, _mm_load_si128((const __m128i *)g->rk[i]));
    return _mm_aesenclast_si128(x, _mm_load_si128((const __m128i *)g->rk[14]));
}

FMQ_AG_T static void fmq_ag_init(fmq_aesgmac *g, const unsigned char key[32]) {
    __m128i even = fmq_ag_load(key), odd = fmq_ag_load(key + 16);
    _mm_store_si128((__m128i *)g->rk[0], even);
    _mm_store_si128((__m128i *)g->rk[1], odd);
    /* (aeskeygenassist takes its round constant as an immediate) */
#define FMQ_AG_ROUND(i, rcon)                                                                \
    even = FMQ_AG_EVEN(even, odd, rcon);                                                     \
    _mm_store_si128((__m128i *)g->rk[i], even);                                              \
    if (i < 14) {                                                                            \
        odd = FMQ_AG_ODD(odd, even);                                                         \
        _mm_store_si128((__m128i *)g->rk[(i) + 1], odd);                                     \
    }
    FMQ_AG_ROUND(2, 0x01) FMQ_AG_ROUND(4, 0x02) FMQ_AG_ROUND(6, 0x04) FMQ_AG_ROUND(8, 0x08)
    FMQ_AG_ROUND(10, 0x10) FMQ_AG_ROUND(12, 0x20) FMQ_AG_ROUND(14, 0x40)
#undef FMQ_AG_ROUND
    __m128i h = fmq_ag_reverse(fmq_ag_aes(g, _mm_setzero_si128())), p = h;
    for (int i = 0; i < 64; i++) {    /* p = H^(i+1) */
        if (i < 8)
            _mm_store_si128((__m128i *)g->hp[i], p);
        _mm_storeu_si128((__m128i *)&g->hw[(63 - i) / 4][16 * ((63 - i) % 4)], p);
        p = fmq_ag_mul(p, h);
    }
    for (int j = 0; j < 16; j++)
        for (int b = 0; b < 64; b += 16)
            for (int i = 0; i < 8; i++)
                g->hk[j][b + i] = g->hk[j][b + 8 + i] = g->hw[j][b + i] ^ g->hw[j][b + 8 + i];
    g->wide = fmq_aesgmac_cpu_wide();
}

/* x after 128 bytes at p (eight blocks, one reduction) */
FMQ_AG_T static inline __m128i fmq_ag_absorb128(const fmq_aesgmac *g, __m128i x,
                                                const uint8_t *p) {
    __m128i lo, hi, l, h;
    fmq_ag_clmul(_mm_xor_si128(x, fmq_ag_reverse(fmq_ag_load(p))),
                 _mm_load_si128((const __m128i *)g->hp[7]), &lo, &hi);
    for (int i = 1; i < 8; i++) {
        fmq_ag_clmul(fmq_ag_reverse(fmq_ag_load(p + 16 * i)),
                     _mm_load_si128((const __m128i *)g->hp[7 - i]), &l, &h);
        lo = _mm_xor_si128(lo, l);
        hi = _mm_xor_si128(hi, h);
    }
    return fmq_ag_reduce(lo, hi);
}

FMQ_AG_T512 static inline __m128i fmq_ag_fold4(__m512i v) {
    return _mm_xor_si128(_mm_xor_si128(_mm512_extracti32x4_epi32(v, 0),
                                       _mm512_extracti32x4_epi32(v, 1)),
                         _mm_xor_si128(_mm512_extracti32x4_epi32(v, 2),
                                       _mm512_extracti32x4_epi32(v, 3)));
}

/* x after n KiB at p (64 blocks per reduction, four per instruction;
 * Karatsuba: three products per block).  Two steps per turn, each
 * accumulator taking both steps' products in one three-way xor: the
 * carry-less multiplies bound this loop, and fewer other instructions
 * leave them more of the vector units (about 10% faster here). */
FMQ_AG_T512 static __m128i fmq_ag_absorb_wide(const fmq_aesgmac *g, __m128i x,
                                              const uint8_t *p, size_t n) {
    const __m512i rev = _mm512_broadcast_i32x4(
        _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (; n; n--, p += 1024) {
        __m512i lo = _mm512_setzero_si512(), hi = lo, mid = lo;
        for (int j = 0; j < 16; j += 2) {
            __m512i d = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 64 * j), rev);
            __m512i e = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 64 * j + 64), rev);
            if (j == 0)
                d = _mm512_xor_si512(d, _mm512_zextsi128_si512(x));
            __m512i k = _mm512_load_si512(g->hw[j]), kk = _mm512_load_si512(g->hw[j + 1]);
            __m512i dd = _mm512_xor_si512(d, _mm512_shuffle_epi32(d, 0x4E));
            __m512i ee = _mm512_xor_si512(e, _mm512_shuffle_epi32(e, 0x4E));
            lo = _mm512_ternarylogic_epi64(lo, _mm512_clmulepi64_epi128(d, k, 0x00),
                                           _mm512_clmulepi64_epi128(e, kk, 0x00), 0x96);
            hi = _mm512_ternarylogic_epi64(hi, _mm512_clmulepi64_epi128(d, k, 0x11),
                                           _mm512_clmulepi64_epi128(e, kk, 0x11), 0x96);
            mid = _mm512_ternarylogic_epi64(mid,
                    _mm512_clmulepi64_epi128(dd, _mm512_load_si512(g->hk[j]), 0x00),
                    _mm512_clmulepi64_epi128(ee, _mm512_load_si512(g->hk[j + 1]), 0x00), 0x96);
        }
        mid = _mm512_ternarylogic_epi64(mid, lo, hi, 0x96);
        lo = _mm512_xor_si512(lo, _mm512_bslli_epi128(mid, 8));
        hi = _mm512_xor_si512(hi, _mm512_bsrli_epi128(mid, 8));
        x = fmq_ag_reduce(fmq_ag_fold4(lo), fmq_ag_fold4(hi));
    }
    return x;
}

/* The tag over parts[0..n) taken as one string, under nonce (12 bytes). */
FMQ_AG_T static void fmq_ag_tag(const fmq_aesgmac *g, const unsigned char nonce[12],
                                const unsigned char *const *parts, const size_t *lens, int n,
                                unsigned char tag[16]) {
    __m128i x = _mm_setzero_si128(), h = _mm_load_si128((const __m128i *)g->hp[0]);
    _Alignas(16) uint8_t buf[128];   /* a run of blocks that spans parts */
    size_t have = 0;
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        const uint8_t *p = parts[i];
        size_t left = lens[i];
        total += left;
        if (have) {
            size_t take = sizeof buf - have < left ? sizeof buf - have : left;
            memcpy(buf + have, p, take);
            have += take;
            p += take;
            left -= take;
            if (have < sizeof buf)
                continue;
            x = fmq_ag_absorb128(g, x, buf);
            have = 0;
        }
        if (g->wide && left >= 1024) {
            x = fmq_ag_absorb_wide(g, x, p, left / 1024);
            p += left & ~(size_t)1023;
            left &= 1023;
        }
        for (; left >= sizeof buf; p += sizeof buf, left -= sizeof buf)
            x = fmq_ag_absorb128(g, x, p);
        memcpy(buf, p, left);
        have = left;
    }
    /* what is left, block by block, the last one padded with zeros */
    memset(buf + have, 0, sizeof buf - have);
    for (size_t off = 0; off < have; off += 16)
        x = fmq_ag_mul(_mm_xor_si128(x, fmq_ag_reverse(fmq_ag_load(buf + off))), h);
    /* the lengths block (bits of associated data, then of ciphertext: none),
     * reversed: the data's length lands in the high half */
    x = fmq_ag_mul(_mm_xor_si128(x, _mm_set_epi64x((long long)(total * 8), 0)), h);
    _Alignas(16) uint8_t j0[16];   /* GCM's first counter block: nonce || 1 */
    memcpy(j0, nonce, 12);
    j0[12] = j0[13] = j0[14] = 0;
    j0[15] = 1;
    __m128i t = _mm_xor_si128(fmq_ag_reverse(x),
                              fmq_ag_aes(g, _mm_load_si128((const __m128i *)j0)));
    _mm_storeu_si128((__m128i *)tag, t);
}

#else   /* not x86-64: fmq_aesgmac_new() returns NULL, fmq_gmac.h's libcrypto path is used */

static int fmq_aesgmac_cpu(void) { return 0; }
static void fmq_ag_init(fmq_aesgmac *g, const unsigned char key[32]) { (void)g; (void)key; }
static void fmq_ag_tag(const fmq_aesgmac *g, const unsigned char nonce[12],
                       const unsigned char *const *parts, const size_t *lens, int n,
                       unsigned char tag[16]) {
    (void)g; (void)nonce; (void)parts; (void)lens; (void)n;
    memset(tag, 0, 16);
}

#endif

/* A keyed context (64-byte aligned), or NULL (no memory, or a CPU without
 * the instructions: check fmq_aesgmac_cpu() first). */
static fmq_aesgmac *fmq_aesgmac_new(const unsigned char key[32]) {
    void *mem = NULL;
    if (!fmq_aesgmac_cpu() || posix_memalign(&mem, 64, sizeof(fmq_aesgmac)) != 0)
        return NULL;
    fmq_ag_init((fmq_aesgmac *)mem, key);
    return (fmq_aesgmac *)mem;
}

/* Round keys and powers of H are the key's: wiped before the memory goes back. */
static void fmq_aesgmac_free(fmq_aesgmac *g) {
    if (!g)
        return;
    volatile uint8_t *v = (volatile uint8_t *)g;
    for (size_t i = 0; i < sizeof *g; i++)
        v[i] = 0;
    free(g);
}

static int fmq_aesgmac_wide(const fmq_aesgmac *g) { return g->wide; }

/* Keep long runs on the 128-bit path (the tests compare both paths). */
static void fmq_aesgmac_narrow(fmq_aesgmac *g) { g->wide = 0; }

#endif
