from libc.stdint cimport uint8_t, uint64_t
from fastmq._segment cimport Segment

cdef class ArenaEnd:
    cdef readonly Segment segment
    # The process that created or attached this end; only it changes the
    # arena's shared flags through it (see fastmq/_native/fmq_proc.h).
    cdef readonly long owner_pid
    cdef readonly str name
    cdef char *base
    cdef char *data
    cdef readonly int n_reader
    cdef readonly int n_slots
    cdef readonly Py_ssize_t slot_bytes
    cdef readonly Py_ssize_t total_bytes
    cdef readonly Py_ssize_t flags_off
    cdef readonly Py_ssize_t data_off
    cdef Py_ssize_t stride
    cdef readonly uint64_t token
    cdef readonly int reader_rank          # -1 on the writer
    cdef readonly bint closed
    cdef readonly bint isolated            # readers map the slots copy-on-write

    # -- writer ------------------------------------------------------------
    cdef public Py_ssize_t min_bytes
    cdef public int copy_threads
    cdef public Py_ssize_t copy_min_part
    cdef public bint prefault_ahead
    cdef int *reserved                     # live writer SlotBuffers per slot
    cdef uint8_t *in_message               # published by the message being encoded
    cdef int n_in_message
    cdef uint64_t *faulted                 # bytes from the slot start known populated
    cdef uint8_t *prefault_queued
    cdef object skip_buffer
    cdef object prefault_jobs
    cdef object prefault_lock
    cdef bint prefault_running
    cdef int cancel_prefault
    cdef int prefault_error
    cdef bint logged_oversize
    cdef bint logged_exhausted
    cdef bint logged_nomem
    cdef uint64_t n_hits, n_hit_bytes, n_inplace, n_exhausted, n_oversize
    cdef uint64_t n_declined, n_small, n_nomem, n_empty, n_empty_miss, n_prefaulted

    # -- reader ------------------------------------------------------------
    cdef int *refs                         # live reader SlotBuffers per slot
    cdef uint64_t *ref_epoch               # epoch those SlotBuffers view
    cdef list pending                      # released slots waiting for an event
    cdef list deferred                     # [(event, [slot, ...]), ...]
    cdef object cuda
    cdef bint pin_attempted
    cdef readonly bint pinned
    cdef uint64_t n_views, n_released, n_event_gated
    cdef uint64_t n_cow_bytes, n_slot_discards, n_discard_failed
    cdef bint logged_discard

    cdef inline char *line(self, int slot) noexcept nogil
    cdef inline char *slot_ptr(self, int slot) noexcept nogil
    cdef bint slot_free(self, int slot) noexcept nogil
    cdef uint64_t publish(self, int slot) noexcept nogil
    cdef int claim(self) noexcept nogil
    cdef bytes descriptor(self, int slot, uint64_t offset, uint64_t nbytes, uint64_t epoch)
    cdef object view_to_slot(self, Py_buffer *view)
    cdef object copy_in(self, int slot, const char *src, Py_ssize_t nbytes)
    cdef object in_place(self, char *ptr, Py_ssize_t nbytes)
    cdef int populate_for_use(self, int slot, Py_ssize_t nbytes) except -2
    cdef int reserve_pages(self, int slot, Py_ssize_t start, Py_ssize_t n) except -2
    cdef object after_cold_use(self, int slot)
    cdef object resolve(self, const char *desc)
    cdef object maybe_pin(self)
    cdef void drop_writer_ref(self, int slot) noexcept
    cdef void drop_reader_ref(self, int slot) noexcept
    cdef void mark_done(self, int slot) noexcept
    cdef int discard(self, int slot) noexcept
    cdef void release_named(self, const char *desc) noexcept


cdef class SlotBuffer:
    cdef ArenaEnd arena
    cdef char *ptr
    cdef readonly Py_ssize_t nbytes
    cdef readonly int slot
    cdef readonly bint writer_side
