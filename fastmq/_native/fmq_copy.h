/* fmq_copy.h: one large copy into an arena slot, split over threads; and
 * populating a large fresh buffer the same way.
 *
 * Where one thread does not saturate memory bandwidth, copying parts of a
 * large buffer in parallel shortens the writer's enqueue().  Each step
 * populates its cold pages (fmq_populate.h) before it writes them, so a
 * full /dev/shm becomes an error return, never a SIGBUS.  Fresh pages are
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

/* One copy's shared state.  The threads claim it a step at a time, so
 * a thread that shares its core with another runnable thread (a spinning
 * OpenMP worker of the caller's torch, another process) does fewer steps
 * instead of holding the others at the join: with fixed halves the copy
 * took as long as its slowest thread's half.  A step populates its cold
 * pages and then copies them while the lines the kernel just zeroed are
 * still in this core's cache. */
typedef struct {
    char *dst; const char *src; size_t n; size_t cold_from;
    size_t next;   /* the next unclaimed offset (atomic) */
    int err;       /* the first failed populate's errno (atomic) */
} fmq_copy_job_t;

#define FMQ_COPY_STEP_BYTES ((size_t)256 * 1024)

/* Claim and run steps until none is left or one failed.  A page is
 * written only once populated, so a full /dev/shm is an error return,
 * never a SIGBUS; the caller publishes nothing then. */
static inline void fmq_copy_job_run(fmq_copy_job_t *j) {
    size_t off, len, cold;
    int e, none;
    for (;;) {
        off = __atomic_fetch_add(&j->next, FMQ_COPY_STEP_BYTES, __ATOMIC_RELAXED);
        if (off >= j->n || __atomic_load_n(&j->err, __ATOMIC_RELAXED)) return;
        len = j->n - off < FMQ_COPY_STEP_BYTES ? j->n - off : FMQ_COPY_STEP_BYTES;
        if (off + len > j->cold_from) {
            cold = off > j->cold_from ? off : j->cold_from;
            e = fmq_populate(j->dst + cold, off + len - cold);
            if (e) {
                none = 0;
                __atomic_compare_exchange_n(&j->err, &none, e, 0,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED);
                return;
            }
        }
        if (j->src != NULL)
            memcpy(j->dst + off, j->src + off, len);
    }
}

static void *fmq_copy_job_thread(void *arg) {
    fmq_copy_job_run((fmq_copy_job_t *)arg);
    return NULL;
}

/* Copy n bytes, first populating each step's pages from cold_from on,
 * with up to `threads` threads (the caller is one; no more than n /
 * min_part).  A thread that cannot be created leaves its steps to the
 * others.  pthread_join orders every thread's stores before the caller's
 * return.  Returns 0 or the errno of a failed populate (nothing is
 * published then); *used is the number of threads that copied. */
static inline int fmq_parallel_copy(char *dst, const char *src, size_t n, size_t cold_from,
                                    int threads, size_t min_part, int *used) {
    fmq_copy_job_t job;
    pthread_t tids[FMQ_COPY_MAX_THREADS];
    int started[FMQ_COPY_MAX_THREADS];
    int t = threads, i;
    if (t > FMQ_COPY_MAX_THREADS) t = FMQ_COPY_MAX_THREADS;
    if (min_part < FMQ_PAGE_BYTES) min_part = FMQ_PAGE_BYTES;
    if ((size_t)t > n / min_part) t = (int)(n / min_part);
    if (t < 1) t = 1;
    job.dst = dst;
    job.src = src;   /* NULL: populate only */
    job.n = n;
    job.cold_from = cold_from;
    job.next = 0;
    job.err = 0;
    *used = 1;
    for (i = 1; i < t; i++) {
        started[i] = pthread_create(&tids[i], NULL, fmq_copy_job_thread, &job) == 0;
        if (started[i]) (*used)++;
    }
    fmq_copy_job_run(&job);
    for (i = 1; i < t; i++)
        if (started[i]) pthread_join(tids[i], NULL);
    return job.err;
}

/* Populate n bytes at p (whole pages, as fmq_populate) with up to
 * `threads` threads, parts of min_part bytes at least: the copy above
 * with nothing to copy.  Returns 0 or the errno of a failed populate. */
static inline int fmq_parallel_populate(char *p, size_t n, int threads, size_t min_part) {
    int used;
    return fmq_parallel_copy(p, NULL, n, 0, threads, min_part, &used);
}

#endif /* FMQ_COPY_H */
