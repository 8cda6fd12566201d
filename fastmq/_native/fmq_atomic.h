/* fmq_atomic.h: the only place fastmq touches shared-memory words (and the
 * words that threads of one process share).
 *
 * Every flag and counter that another process reads is a plain fixed-width
 * integer in the mapping, accessed only through these helpers so that the
 * memory order of each access is explicit at the call site.  The writer
 * publishes a chunk with a release store; a reader observes it with an
 * acquire load, which makes every byte the writer copied before the release
 * visible to the reader after the acquire (and symmetrically for read flags).
 *
 * Parking uses Linux futexes on 32-bit aligned words in the shared mapping
 * (not FUTEX_PRIVATE: the waiters live in other processes).  On other
 * systems FMQ_HAVE_FUTEX is 0 and the Python layer falls back to ZMQ.
 *
 * The ordering argument and the futex protocol: docs/design.md.
 */
#ifndef FMQ_ATOMIC_H
#define FMQ_ATOMIC_H

#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <sched.h>

#if defined(__linux__)
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#define FMQ_HAVE_FUTEX 1
#else
#define FMQ_HAVE_FUTEX 0
#endif

static inline uint8_t fmq_load_u8_acq(const volatile uint8_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void fmq_store_u8_rel(volatile uint8_t *p, uint8_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline uint32_t fmq_load_u32_acq(const volatile uint32_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline uint32_t fmq_load_u32_seq(const volatile uint32_t *p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static inline void fmq_store_u32_rel(volatile uint32_t *p, uint32_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline uint32_t fmq_add_u32_seq(volatile uint32_t *p, uint32_t v) {
    return __atomic_add_fetch(p, v, __ATOMIC_SEQ_CST);
}
static inline uint32_t fmq_sub_u32_seq(volatile uint32_t *p, uint32_t v) {
    return __atomic_sub_fetch(p, v, __ATOMIC_SEQ_CST);
}
static inline uint64_t fmq_load_u64_acq(const volatile uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void fmq_store_u64_rel(volatile uint64_t *p, uint64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline int fmq_cas_u32(volatile uint32_t *p, uint32_t expected, uint32_t desired) {
    return __atomic_compare_exchange_n(p, &expected, desired, 0,
                                       __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
static inline int fmq_cas_u64(volatile uint64_t *p, uint64_t expected, uint64_t desired) {
    return __atomic_compare_exchange_n(p, &expected, desired, 0,
                                       __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
/* Touch a shared page without changing it: an atomic add of 0 cannot lose
 * another process's concurrent store (pre-faulting where the kernel lacks
 * MADV_POPULATE_WRITE). */
static inline void fmq_touch_u8(volatile uint8_t *p) {
    (void)__atomic_fetch_add(p, 0, __ATOMIC_RELAXED);
}

/* Process-private words read and written by several threads of one process
 * (the arena writer's bookkeeping, shared with its pre-fault thread). */
static inline uint64_t fmq_local_load_u64_acq(uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
/* Raise *p to v (never lower it), release: what was populated up to v is
 * visible to a thread that acquires the new value. */
static inline void fmq_local_max_u64_rel(uint64_t *p, uint64_t v) {
    uint64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, 0, __ATOMIC_RELEASE,
                                                   __ATOMIC_RELAXED)) {}
}
static inline int fmq_local_load_int(int *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void fmq_local_store_int(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

/* Full barrier: orders a preceding store before a following load (the
 * "register as parked, then re-check" handshake needs store->load order,
 * which acquire/release alone does not give). */
static inline void fmq_fence_seq(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

static inline void fmq_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline int fmq_sched_yield(void) { return sched_yield(); }

static inline int64_t fmq_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int fmq_have_futex(void) { return FMQ_HAVE_FUTEX; }

/* Sleep while *addr == expected, at most timeout_ns.  Returns 0 on wake,
 * or an errno value (EAGAIN: the word already changed; ETIMEDOUT; EINTR). */
static inline int fmq_futex_wait(volatile uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
#if FMQ_HAVE_FUTEX
    struct timespec ts;
    if (timeout_ns < 0) timeout_ns = 0;
    ts.tv_sec = timeout_ns / 1000000000LL;
    ts.tv_nsec = timeout_ns % 1000000000LL;
    long rc = syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, &ts, NULL, 0);
    return rc == 0 ? 0 : errno;
#else
    (void)addr; (void)expected; (void)timeout_ns;
    return ENOSYS;
#endif
}

static inline int fmq_futex_wake_all(volatile uint32_t *addr) {
#if FMQ_HAVE_FUTEX
    long rc = syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
    return rc < 0 ? -errno : (int)rc;
#else
    (void)addr;
    return -ENOSYS;
#endif
}

#endif /* FMQ_ATOMIC_H */
