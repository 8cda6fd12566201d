/* fmq_stream_copy.h: a copy into memory that will not be read soon from
 * this core's cache, with streaming (non-temporal) stores.
 *
 * A remote reader receives a large frame's segment into a small buffer
 * that stays in cache, checks it there (and decrypts it), then copies it
 * into the frame.  The frame is larger than the caches; an ordinary store
 * first reads each line of it (the old contents of a reused block) only to
 * overwrite it.  A streaming store writes the line without reading it.
 * Measured with four readers on one core, 16 MiB frames, reading every
 * byte afterwards: about 0.8 ms per 16 MiB copy against 1.2-1.4 for
 * memcpy, the later read a little slower, the sum lower.
 *
 * SSE2 is part of x86-64, so no dispatch; elsewhere it is memcpy.  The
 * sfence orders the streaming stores before whatever the caller publishes
 * next (they are weakly ordered).
 */
#ifndef FMQ_STREAM_COPY_H
#define FMQ_STREAM_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>

static inline void fmq_stream_copy(char *dst, const char *src, size_t n)
{
    /* The head up to dst's first 64-byte line boundary, ordinarily. */
    size_t head = (size_t)((64 - ((uintptr_t)dst & 63)) & 63);
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++) {
        const __m128i *s = (const __m128i *)(src + 64 * i);
        __m128i *d = (__m128i *)(dst + 64 * i);
        __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
        __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
        _mm_stream_si128(d, a);
        _mm_stream_si128(d + 1, b);
        _mm_stream_si128(d + 2, c);
        _mm_stream_si128(d + 3, e);
    }
    _mm_sfence();
    memcpy(dst + 64 * lines, src + 64 * lines, n - 64 * lines);
}
#else
static inline void fmq_stream_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}
#endif

#endif
