/* fmq_copy.h: one large copy into an arena slot, split over threads; and
 * populating a large fresh buffer the same way.
 *
 * Where one thread does not saturate memory bandwidth, copying parts of a
 * large buffer in parallel shortens the writer's enqueue().  Each part first
 * populates its cold pages (fmq_populate.h), so a full /dev/shm becomes an
 * error return before any byte is stored, never a SIGBUS.  Fresh pages are
 * bound by the kernel's work per page (allocate, zero, map), which two
 * threads do at nearly twice the rate: a remote reader's first large frame
 * is received into memory populated so (fmq_parallel_populate).
 */
#ifndef FMQ_COPY_H
#define FMQ_COPY_H

#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "fmq_populate.h"

#define FMQ_COPY_MAX_THREADS 16

typedef struct {
    char *dst; const char *src; size_t n; size_t cold; int err;
} fmq_copy_part_t;

static inline void fmq_copy_part_run(fmq_copy_part_t *p) {
    if (p->cold < p->n) {
        p->err = fmq_populate(p->dst + p->cold, p->n - p->cold);
        if (p->err) return;
    }
    if (p->src != NULL)
        memcpy(p->dst, p->src, p->n);
}

static void *fmq_copy_part_thread(void *arg) {
    fmq_copy_part_run((fmq_copy_part_t *)arg);
    return NULL;
}

/* Copy n bytes, first populating the part from cold_from on, with up to
 * `threads` threads (the caller is one).  Parts are page multiples, so
 * no two threads fault or write the same page.  A thread that cannot be
 * created is replaced by the caller doing its part.  Returns 0 or the
 * errno of a failed populate (nothing is published then); *used is the
 * number of threads that copied. */
static inline int fmq_parallel_copy(char *dst, const char *src, size_t n, size_t cold_from,
                                    int threads, size_t min_part, int *used) {
    fmq_copy_part_t parts[FMQ_COPY_MAX_THREADS];
    pthread_t tids[FMQ_COPY_MAX_THREADS];
    int started[FMQ_COPY_MAX_THREADS];
    int t = threads, k = 0, i, err;
    size_t part, off = 0, len;
    if (t > FMQ_COPY_MAX_THREADS) t = FMQ_COPY_MAX_THREADS;
    if (min_part < FMQ_PAGE_BYTES) min_part = FMQ_PAGE_BYTES;
    if ((size_t)t > n / min_part) t = (int)(n / min_part);
    if (t < 1) t = 1;
    part = fmq_page_round(n / (size_t)t);
    for (i = 0; i < t && off < n; i++) {
        len = (i == t - 1 || part > n - off) ? n - off : part;
        parts[i].dst = dst + off;
        parts[i].src = src != NULL ? src + off : NULL;   /* NULL: populate only */
        parts[i].n = len;
        parts[i].cold = cold_from <= off ? 0 : (cold_from - off < len ? cold_from - off : len);
        parts[i].err = 0;
        off += len;
        k = i + 1;
    }
    *used = 1;
    for (i = 1; i < k; i++) {
        started[i] = pthread_create(&tids[i], NULL, fmq_copy_part_thread, &parts[i]) == 0;
        if (started[i]) (*used)++;
    }
    if (k > 0) fmq_copy_part_run(&parts[0]);
    err = k > 0 ? parts[0].err : 0;
    for (i = 1; i < k; i++) {
        if (started[i]) pthread_join(tids[i], NULL);
        else fmq_copy_part_run(&parts[i]);
        if (!err) err = parts[i].err;
    }
    return err;
}

/* Populate n bytes at p (whole pages, as fmq_populate) with up to
 * `threads` threads, parts of min_part bytes at least: the copy above
 * with nothing to copy.  Returns 0 or the errno of a failed populate. */
static inline int fmq_parallel_populate(char *p, size_t n, int threads, size_t min_part) {
    int used;
    return fmq_parallel_copy(p, NULL, n, 0, threads, min_part, &used);
}

#endif /* FMQ_COPY_H */
