"""Kernel arguments Triton must not specialise on.

Triton compiles a kernel once per specialisation, and a pointer argument's 16-byte alignment is
part of it. The index arrays of a prefill step (row starts and ends, state slots, initial-state
flags, snapshot heads and rows) are often slices of larger host-built tensors, aligned in one
step and not in the next: each new combination compiled the kernel again mid-serving (3.6 s for
the chunked GDN kernel on an H200, seen with DELTASERVE_LOG_COMPILES=1). They are read one
scalar per program, so alignment buys nothing: `triton.jit(do_not_specialize_on_alignment=
INDEX_ARGS)` keeps one variant. Names a kernel lacks are ignored by Triton.

The paged-attention kernels (attention and MLA, prefill and split decode) read their block
tables, query starts and sequence lengths the same way (`TABLE_ARGS`), and take two per-step
integers, the batch's sequence count and the block table's row stride (its width): Triton also
specialises an int argument on being 1 or a multiple of 16, so a step of 16 prefill rows or a
table 16 blocks wide compiled the attention prefill kernel again mid-serving (about 2 s each on
a fresh H200, in a multi-turn benchmark with varied lengths). They index one scalar per tile:
`triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=TABLE_ARGS)`.
"""

from __future__ import annotations

INDEX_ARGS = (
    "starts_ptr",
    "ends_ptr",
    "slots_ptr",
    "init_ptr",
    "has_init_ptr",
    "qsl_ptr",
    "ckpt_ptr",
    "ckpt_rows_ptr",
)

TABLE_ARGS = INDEX_ARGS + ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")
STEP_INTS = ("num_seqs", "stride_bt")
