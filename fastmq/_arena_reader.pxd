from libc.stdint cimport uint64_t
from fastmq._arena cimport ArenaEnd

cdef class ArenaReaderEnd(ArenaEnd):
    cdef readonly int reader_rank
    # The process that attached this end; only it changes the arena's
    # shared flags through it (see fastmq/_native/fmq_proc.h).
    cdef readonly long owner_pid
    cdef int *refs                         # live reader SlotBuffers per slot
    cdef uint64_t *ref_epoch               # epoch those SlotBuffers view
    # Isolated: per slot, the furthest byte any view reached since this
    # reader's private pages there were last dropped (0: nothing to drop).
    cdef uint64_t *view_end
    # Isolated: per slot, this process's page-fault count read just before
    # its private pages there were last dropped (0: none recorded).  While
    # the count is unchanged no page there can have been copied (a copy is
    # a fault), so the next drop has nothing to find and skips the walk.
    cdef uint64_t *clean_faults
    cdef list pending                      # released slots waiting for an event
    cdef list deferred                     # [(event, [slot, ...]), ...]
    cdef object cuda
    cdef object cuda_source                # has runtime(): fastmq._cuda (set_cuda_source)
    cdef bint pin_attempted
    cdef readonly bint pinned
    cdef uint64_t n_views, n_released, n_event_gated
    cdef uint64_t n_cow_bytes, n_slot_discards, n_discard_failed, n_walks_skipped
    cdef bint logged_discard

    cdef object resolve(self, const char *desc)
    cdef void release_named(self, const char *desc) noexcept
    cdef object maybe_pin(self)
    cdef void mark_done(self, int slot) noexcept
    cdef void drop_private(self) noexcept
    cdef int discard(self, int slot, uint64_t faults) noexcept
