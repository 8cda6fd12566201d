# The ring segment's header: byte offsets from the mapping's base.  One
# definition, cimported by the ring itself (fastmq/_ring.pyx and its ends,
# fastmq/_ring_writer.pyx and fastmq/_ring_reader.pyx) and by the
# read-only inspection code that ``fastmq ls`` and ``fastmq cleanup`` use,
# so that nothing restates them.
cdef enum:
    H_MAGIC = 0            # u64
    H_VERSION = 8          # u32
    H_NREADER = 12         # u32
    H_CHUNK_BYTES = 16     # u64
    H_NCHUNKS = 24         # u32
    H_META_STRIDE = 28     # u32
    H_META_OFF = 32        # u64
    H_DATA_OFF = 40        # u64
    H_TOTAL = 48           # u64
    H_WAIT_MODE = 56       # u32
    H_SPIN_NS = 64         # u64
    H_WRITER_PID = 72      # u32
    H_WRITER_START = 80    # u64  (process start time, clock ticks since boot)
    H_WRITER_STATE = 88    # u32  1 = open, 2 = closed by its writer
    H_PUBLISHED = 96       # u64  messages the writer has published
    H_OVERFLOW_ID = 104    # u64  id of the newest overflow mark published
    H_WRITER_PIDNS = 112   # u64  inode of the writer's pid namespace (0: unknown)
    H_READ_SEQ = 128       # u32 futex word that readers park on
    H_READERS_PARKED = 192 # u32 count of parked readers
    H_WRITE_SEQ = 256      # u32 futex word that the writer parks on
    H_WRITER_PARKED = 320  # u32 1 while the writer is parked
    H_READER_SLOTS = 512   # 64 B per reader: u64 claim word (+0), u64 start
                           # time (+8), u64 messages this reader has read (+16),
                           # u64 1 while the reader waits for a chunk (+24)
    READER_SLOT = 64
    SLOT_START = 8
    SLOT_READ = 16
    SLOT_WAITING = 24

# A reader slot's claim word, swapped whole (one 64-bit CAS) so that no
# process ever sees a holder's pid with another process's start time:
#
#   bits  0..31  pid of the holder (0: never claimed)
#   bits 32..62  the holder's start time, low 31 bits (tells a reused pid)
#   bit  63      LEFT: the holder closed its end; the pid stays, so that
#                the writer can name the reader that left
#
# The full start time at +8 is written after the claim, for `fastmq ls`.
cdef enum:
    CLAIM_LEFT_BIT = 63
    CLAIM_PID_MASK = 0xFFFFFFFF
    CLAIM_TAG_MASK = 0x7FFFFFFF
