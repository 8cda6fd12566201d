/* fmq_heap.h: keep the heap of a process that unpickles large messages in
 * pieces.
 *
 * glibc's malloc hands the top of its heap back to the kernel once more
 * than M_TRIM_THRESHOLD of it is free (128 KiB until told otherwise), and
 * raises that threshold by itself to twice the size of the largest block
 * it had to mmap and then freed (up to 32 MiB).  A reader that receives a
 * large message into one buffer frees such a block after every message,
 * so the heap its objects live in stays mapped.  fastmq's readers unpickle
 * in place from a ring chunk, from pooled memory, or piece by piece
 * (fastmq/_piecewise.py), and never allocate one: hence fastmq/_ring.pyx's
 * decode calls fmq_heap_hint through heap_keep.  Without it,
 * freeing a list of 16 MiB of small objects returns the heap to the
 * kernel (a page-table walk and a TLB flush), and the next message faults
 * every page in again, zero-filled -- measured on 2 vCPUs, about a third
 * of a 16 MiB list's round trip.  One mmapped block of the message's size,
 * allocated and freed once, moves glibc's thresholds as that buffer would
 * have: nothing is touched, the mapping costs a few microseconds, and the
 * process keeps what its own objects use, as every reader of such
 * messages already did.  Other C libraries: nothing to do.
 */
#ifndef FMQ_HEAP_H
#define FMQ_HEAP_H

#include <stddef.h>
#include <stdlib.h>

/* glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, less its chunk header and
 * page rounding: a larger block would not move the thresholds. */
#define FMQ_HEAP_HINT_MAX (((size_t)32 << 20) - ((size_t)64 << 10))

static inline void fmq_heap_hint(size_t n) {
#ifdef __GLIBC__
    void *volatile p;   /* volatile: the compiler must not elide the pair */
    if (n > FMQ_HEAP_HINT_MAX) n = FMQ_HEAP_HINT_MAX;
    p = malloc(n);
    free(p);
#else
    (void)n;
#endif
}

#endif /* FMQ_HEAP_H */
