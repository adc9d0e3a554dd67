"""Kernel arguments Triton must not specialise on.

Triton compiles a kernel once per specialisation, and a pointer argument's 16-byte alignment is
part of it. The index arrays of a prefill step (row starts and ends, state slots, initial-state
flags, snapshot heads and rows) are often slices of larger host-built tensors, aligned in one
step and not in the next: each new combination compiled the kernel again mid-serving (3.6 s for
the chunked GDN kernel on an H200, seen with DELTASERVE_LOG_COMPILES=1). They are read one
scalar per program, so alignment buys nothing: `triton.jit(do_not_specialize_on_alignment=
INDEX_ARGS)` keeps one variant. Names a kernel lacks are ignored by Triton.
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
