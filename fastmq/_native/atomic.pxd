# Declarations of fmq_atomic.h: the only way Cython code touches words that
# other processes (or other threads of this one) read or write.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t

cdef extern from "fmq_atomic.h" nogil:
    uint8_t fmq_load_u8_acq(const uint8_t *p)
    void fmq_store_u8_rel(uint8_t *p, uint8_t v)
    uint32_t fmq_load_u32_acq(const uint32_t *p)
    uint32_t fmq_load_u32_seq(const uint32_t *p)
    void fmq_store_u32_rel(uint32_t *p, uint32_t v)
    uint32_t fmq_add_u32_seq(uint32_t *p, uint32_t v)
    uint32_t fmq_sub_u32_seq(uint32_t *p, uint32_t v)
    uint64_t fmq_load_u64_acq(const uint64_t *p)
    void fmq_store_u64_rel(uint64_t *p, uint64_t v)
    int fmq_cas_u32(uint32_t *p, uint32_t expected, uint32_t desired)
    int fmq_cas_u64(uint64_t *p, uint64_t expected, uint64_t desired)
    void fmq_touch_u8(uint8_t *p)
    uint64_t fmq_local_load_u64_acq(uint64_t *p)
    void fmq_local_max_u64_rel(uint64_t *p, uint64_t v)
    int fmq_local_load_int(int *p)
    void fmq_local_store_int(int *p, int v)
    void fmq_fence_seq()
    void fmq_cpu_relax()
    int fmq_sched_yield()
    int64_t fmq_now_ns()
    int fmq_have_futex()
    int fmq_futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns)
    int fmq_futex_wake_all(uint32_t *addr)
