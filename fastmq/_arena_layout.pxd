# The arena segment's layout: header offsets from the mapping's base, the
# per-slot flag line, and the slot descriptor a message carries in place of
# a buffer's bytes.  One definition, cimported by the arena's ends
# (fastmq/_arena.pyx) and by the read-only snapshot that ``fastmq ls`` uses
# (fastmq/_snapshot.pyx), so that nothing restates them.
#
#   +-------------------------------+ 0
#   | header (H_*)                  |
#   +-------------------------------+ flags_off = HEADER
#   | line 0 | line 1 | ...         |  per slot, 64-byte aligned:
#   |                               |  [u64 epoch][u8 written][u8 done x n_reader]
#   +-------------------------------+ data_off (2 MiB aligned)
#   | slot 0 | slot 1 | ...         |
#   +-------------------------------+ total
cdef enum:
    H_MAGIC = 0         # u64 (SEG_MAGIC: every segment header begins so)
    H_VERSION = 8       # u32 (SEG_VERSION)
    H_NREADER = 12      # u32
    H_NSLOTS = 16       # u32
    H_STRIDE = 20       # u32
    H_SLOT_BYTES = 24   # u64
    H_FLAGS_OFF = 32    # u64
    H_DATA_OFF = 40     # u64
    H_TOTAL = 48        # u64
    H_TOKEN = 56        # u64 random: ties descriptors to this arena
    H_READERS = 64      # u32 READERS_ISOLATED / READERS_SHARED
    HEADER = 4096
    F_EPOCH = 0         # u64 the slot's publication's number (arena-wide, rising)
    F_WRITTEN = 8       # u8
    F_DONE = 9          # u8 x n_reader
    D_MAGIC = 0         # descriptor: u64
    D_TOKEN = 8         # u64
    D_SLOT = 16         # u32 (+ u32 reserved)
    D_OFFSET = 24       # u64
    D_NBYTES = 32       # u64
    D_EPOCH = 40        # u64
    C_DESC_LEN = 48
