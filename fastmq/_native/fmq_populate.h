/* fmq_populate.h: backing arena pages with memory before they are written.
 *
 * tmpfs allocates a page when it is first written.  If /dev/shm is full at
 * that moment the store is a SIGBUS that kills the writer, so the writer
 * never stores into a page it has not populated: MADV_POPULATE_WRITE
 * (Linux 5.14) allocates and maps a range without changing its contents and
 * returns an error instead of signalling.  On older kernels the arena
 * reserves the range with posix_fallocate on the segment's descriptor first
 * (Segment.reserve), which fails the same way, and only then touches it.
 *
 * The design: docs/design.md, "Tensor arena" ("What it costs").
 */
#ifndef FMQ_POPULATE_H
#define FMQ_POPULATE_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>

#include "fmq_atomic.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif
#define FMQ_PAGE_BYTES 4096

/* n rounded up to whole pages. */
static inline size_t fmq_page_round(size_t n) {
    return (n + FMQ_PAGE_BYTES - 1) & ~(size_t)(FMQ_PAGE_BYTES - 1);
}

/* 1 until the kernel answers EINVAL (older than 5.14). */
static int fmq_populate_ok = 1;

static inline int fmq_have_populate(void) {
    return fmq_local_load_int(&fmq_populate_ok);
}

/* Allocate and map [p, p+n) writable without changing its contents.
 * 0, or the errno: EFAULT/ENOMEM is what would otherwise be a SIGBUS in
 * the middle of a memcpy (tmpfs full) -- the caller falls back instead. */
static inline int fmq_populate(char *p, size_t n) {
    if (n == 0 || !fmq_have_populate()) return 0;
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(FMQ_PAGE_BYTES - 1);
    if (madvise((void *)a, (size_t)((uintptr_t)p + n - a), MADV_POPULATE_WRITE) == 0)
        return 0;
    int e = errno;
    if (e == EINVAL) {
        fmq_local_store_int(&fmq_populate_ok, 0);
        return 0;
    }
    return e;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

/* Map [p, p+n) into this process for reading (MADV_POPULATE_READ, Linux
 * 5.14), where its pages already exist: a first read then takes no page
 * fault.  A hint: 0, or the errno, which callers may ignore. */
static inline int fmq_map_for_reading(char *p, size_t n) {
    if (n == 0) return 0;
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(FMQ_PAGE_BYTES - 1);
    return madvise((void *)a, (size_t)((uintptr_t)p + n - a), MADV_POPULATE_READ) == 0
        ? 0 : errno;
}

static inline void fmq_hugepage(char *p, size_t n) {
    /* Best effort: tmpfs honours it only with shmem_enabled=advise. */
    (void)madvise((void *)p, n, MADV_HUGEPAGE);
}

/* Background pre-fault of [p, p+n) in 2 MiB steps (so that `cancel` is
 * honoured promptly).  Content-preserving either way: populate never
 * writes, and touching is an atomic add of 0, which cannot lose a
 * concurrent store.  0, -1 if cancelled, or an errno. */
static inline int fmq_prefault(char *p, size_t n, int *cancel) {
    const size_t step = (size_t)2 << 20;
    size_t off, len, q;
    int e;
    for (off = 0; off < n; off += step) {
        if (fmq_local_load_int(cancel)) return -1;
        len = n - off < step ? n - off : step;
        if (fmq_have_populate()) {
            e = fmq_populate(p + off, len);
            if (e) return e;
        }
        if (!fmq_have_populate()) {
            for (q = 0; q < len; q += FMQ_PAGE_BYTES)
                fmq_touch_u8((volatile uint8_t *)(p + off + q));
        }
    }
    return 0;
}

#endif /* FMQ_POPULATE_H */
