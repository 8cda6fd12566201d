/* fmq_cow.h: copy-on-write arena slots in readers.
 *
 * A reader maps the arena's slots MAP_PRIVATE: reading maps the shared
 * tmpfs pages themselves (zero copy, and the writer's later stores to those
 * pages are seen through the same page-table entries), while a store by the
 * reader makes a private copy of that one page.  Before the reader views a
 * slot again, its private pages there must go, or the next message in that
 * slot would show this reader's old writes: MADV_DONTNEED on a private file
 * mapping drops them and the range shows the file again.
 *
 * Dropping the whole slot would also drop the entries of every page that
 * was only read, and the next message would fault them all in again (on a
 * 2-vCPU VM: +13 ms for a 128 MiB read, +10 ms for the madvise itself).  So
 * where the kernel has PAGEMAP_SCAN (Linux 6.7), only the ranges that hold
 * anonymous pages (the private copies; present or swapped out) are
 * dropped: one ioctl that walks the slot's page tables (~1.2 ms per
 * 128 MiB read there), and nothing to drop when the reader wrote nothing.
 * The caller does not call at all while its process has taken no page
 * fault since the last drop in that range (ArenaReaderEnd.discard): a
 * private copy is only ever made by a write fault.
 */
#ifndef FMQ_COW_H
#define FMQ_COW_H

#include <errno.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>

#ifndef MAP_NORESERVE
#define MAP_NORESERVE 0
#endif

/* uapi of Linux 6.7 (linux/fs.h), for build hosts with older headers. */
#ifndef PAGEMAP_SCAN
struct page_region {
    uint64_t start;
    uint64_t end;
    uint64_t categories;
};
struct pm_scan_arg {
    uint64_t size;
    uint64_t flags;
    uint64_t start;
    uint64_t end;
    uint64_t walk_end;
    uint64_t vec;
    uint64_t vec_len;
    uint64_t max_pages;
    uint64_t category_inverted;
    uint64_t category_mask;
    uint64_t category_anyof_mask;
    uint64_t return_mask;
};
#define PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define PAGE_IS_FILE (1 << 2)
#define PAGE_IS_PRESENT (1 << 3)
#define PAGE_IS_SWAPPED (1 << 4)
#endif

#define FMQ_COW_VEC 64

/* 1 while PAGEMAP_SCAN may be used: cleared when the kernel refuses it
 * (older than 6.7), or by fmq_cow_set_scan() (tests cover the fallback). */
static int fmq_cow_scan_enabled = 1;

static int fmq_cow_scan_ok(void) {
    return __atomic_load_n(&fmq_cow_scan_enabled, __ATOMIC_RELAXED);
}

static int fmq_cow_set_scan(int on) {
    return __atomic_exchange_n(&fmq_cow_scan_enabled, on ? 1 : 0, __ATOMIC_RELAXED);
}

/* Make [p, p+n) (page aligned, in a MAP_PRIVATE file mapping) show the
 * file again.  `pagemap_fd` is this process's /proc/self/pagemap, or -1.
 * Adds to *private_bytes what was dropped after a scan, or sets *whole
 * when the whole range was dropped blindly.  0, or the errno of a failed
 * madvise (then the caller must not hand the range back). */
static int fmq_cow_discard(int pagemap_fd, char *p, size_t n, uint64_t *private_bytes,
                           int *whole) {
    struct page_region vec[FMQ_COW_VEC];
    struct pm_scan_arg arg;
    uint64_t start = (uint64_t)(uintptr_t)p, end = start + n, found = 0;
    long got, i;
    *whole = 0;
    if (pagemap_fd >= 0 && fmq_cow_scan_ok()) {
        while (start < end) {
            memset(&arg, 0, sizeof(arg));
            arg.size = sizeof(arg);
            arg.start = start;
            arg.end = end;
            arg.vec = (uint64_t)(uintptr_t)vec;
            arg.vec_len = FMQ_COW_VEC;
            /* Not a file page (i.e. a private copy), present or swapped. */
            arg.category_inverted = PAGE_IS_FILE;
            arg.category_mask = PAGE_IS_FILE;
            arg.category_anyof_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;
            arg.return_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;
            got = ioctl(pagemap_fd, PAGEMAP_SCAN, &arg);
            if (got < 0) {
                if (errno == ENOTTY || errno == EINVAL || errno == EOPNOTSUPP)
                    fmq_cow_set_scan(0);
                goto blind;
            }
            for (i = 0; i < got; i++) {
                if (madvise((void *)(uintptr_t)vec[i].start,
                            (size_t)(vec[i].end - vec[i].start), MADV_DONTNEED) != 0)
                    return errno;
                found += vec[i].end - vec[i].start;
            }
            if (arg.walk_end <= start)   /* no progress: never loop forever */
                goto blind;
            start = arg.walk_end;
        }
        *private_bytes += found;
        return 0;
    }
blind:
    if (madvise((void *)p, n, MADV_DONTNEED) != 0)
        return errno;
    *whole = 1;
    return 0;
}

#endif
