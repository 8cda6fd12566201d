/* fmq_growbuf.h: a byte buffer that grows by doubling, large sizes in a
 * mapping of their own.
 *
 * Why not realloc: glibc serves an allocation below its mmap threshold from
 * the heap, and that threshold rises (up to 32 MiB) each time a process
 * frees a larger mapped block -- which a Python process does all the time
 * (numpy, bytes).  A heap block that doubles is a fresh block plus a copy
 * every time, so a 16 MiB pickle stream faulted about twice its size in
 * fresh pages the first time it was written (and left holes in the heap).
 * A mapping doubles with mremap: the kernel moves the page tables, no byte
 * is copied and no page faulted twice.
 *
 * The kind of a buffer follows from its capacity alone: below
 * FMQ_GROWBUF_MAP_MIN it is malloc'd, from it up it is a private anonymous
 * mapping.  Callers keep the capacity beside the pointer and pass both.
 */
#ifndef FMQ_GROWBUF_H
#define FMQ_GROWBUF_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mremap */
#endif
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "fmq_populate.h"   /* fmq_page_round */

#define FMQ_GROWBUF_MAP_MIN ((size_t)256 << 10)

static inline int fmq_growbuf_mapped(size_t cap) {
    return cap >= FMQ_GROWBUF_MAP_MIN;
}

/* A new buffer of cap bytes (contents undefined); NULL when there is no
 * memory.  A mapping's cap is whole pages: callers round it (they double
 * from a page-multiple start). */
static inline char *fmq_growbuf_alloc(size_t cap) {
    if (!fmq_growbuf_mapped(cap))
        return (char *)malloc(cap);
    void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : (char *)p;
}

static inline void fmq_growbuf_free(char *p, size_t cap) {
    if (p == NULL)
        return;
    if (fmq_growbuf_mapped(cap))
        munmap(p, cap);
    else
        free(p);
}

/* The buffer p of old_cap bytes, now new_cap bytes (larger or smaller),
 * its first min(old_cap, new_cap) bytes kept; NULL when there is no memory
 * (p is then still valid, of old_cap bytes). */
static inline char *fmq_growbuf_resize(char *p, size_t old_cap, size_t new_cap) {
    int was = fmq_growbuf_mapped(old_cap), now = fmq_growbuf_mapped(new_cap);
    if (!was && !now)
        return (char *)realloc(p, new_cap);
    if (was && now) {
        void *q = mremap(p, old_cap, new_cap, MREMAP_MAYMOVE);
        return q == MAP_FAILED ? NULL : (char *)q;
    }
    char *q = fmq_growbuf_alloc(new_cap);
    if (q == NULL)
        return NULL;
    memcpy(q, p, old_cap < new_cap ? old_cap : new_cap);
    fmq_growbuf_free(p, old_cap);
    return q;
}

/* A mapping cut down in place to the whole pages that cover its first
 * `used` bytes: its length now (cap where it is no longer than that, or
 * where the kernel refused the split).  Shrinking never moves a mapping.
 * What a buffer hands to a pool, whose blocks are backed throughout, is
 * cut to the pages it has backed. */
static inline size_t fmq_growbuf_trim(char *p, size_t cap, size_t used) {
    size_t keep = fmq_page_round(used);
    if (keep > 0 && keep < cap && mremap(p, cap, keep, 0) != MAP_FAILED)
        return keep;
    return cap;
}

#endif /* FMQ_GROWBUF_H */
