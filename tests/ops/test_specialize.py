"""The prefill path's index arrays do not specialise its kernels (deltaserve/ops/specialize.py):
a step whose slot or snapshot-row slice is not 16-byte aligned reuses the compiled kernel
instead of compiling it again mid-serving."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deltaserve.ops.attention import triton_decode as attention_decode
from deltaserve.ops.attention import triton_prefill as attention_prefill
from deltaserve.ops.gdn import triton_chunked, triton_conv1d, triton_prefill
from deltaserve.ops.mla import triton_decode as mla_decode
from deltaserve.ops.mla import triton_prefill as mla_prefill
from deltaserve.ops.specialize import INDEX_ARGS, STEP_INTS, TABLE_ARGS

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import STAND_IN_DRIVER, ptxas_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

KERNELS = [
    triton_prefill._gdn_prefill_kernel,
    triton_chunked._gdn_chunked_kernel,
    triton_conv1d._conv_prefill_kernel,
]


def specialisation_off(kernel, kind: str) -> dict[str, bool]:
    """{argument: whether `kernel` does not specialise on it} for kind "do_not_specialize" or
    "do_not_specialize_on_alignment"."""
    if hasattr(kernel, "params"):  # compiled
        return {p.name: getattr(p, kind) for p in kernel.params}
    off = kernel.kwargs[kind] or ()  # the CPU interpreter keeps the decorator's arguments
    return {name: name in off for name in kernel.arg_names}


PAGED_KERNELS = [
    attention_prefill._prefill_kernel,
    attention_decode._decode_split_kernel,
    mla_prefill._mla_prefill_kernel,
    mla_decode._mla_decode_split_kernel,
]


@pytest.mark.parametrize("kernel", PAGED_KERNELS, ids=lambda k: k.__name__)
def test_paged_attention_step_arguments_are_not_specialised(kernel):
    """Block tables, query starts and sequence lengths keep one alignment variant; the step's
    sequence count and table width one value variant; data pointers and strides keep theirs."""
    align = specialisation_off(kernel, "do_not_specialize_on_alignment")
    value = specialisation_off(kernel, "do_not_specialize")
    tables = [name for name in align if name in TABLE_ARGS]
    assert "block_tables_ptr" in tables and "seq_lens_ptr" in tables
    assert all(align[name] for name in tables), align
    ints = [name for name in value if name in STEP_INTS]
    assert "stride_bt" in ints and all(value[name] for name in ints), value
    assert not align["out_ptr"] and not value["stride_ot"]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_index_pointers_are_not_specialised_on_alignment(kernel):
    flags = specialisation_off(kernel, "do_not_specialize_on_alignment")
    index = [name for name in flags if name in INDEX_ARGS]
    assert len(index) >= 5, index  # slots, snapshot heads and rows, starts / init flags
    assert all(flags[name] for name in index), flags
    # data pointers keep their alignment (vectorised loads of activations and states)
    assert not flags["state_ptr"] and not flags["out_ptr"]


SCRIPT = STAND_IN_DRIVER + textwrap.dedent(
    """
    from deltaserve.ops.specialize import INDEX_ARGS
    compiles = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiles.append(kw["fn"].name)


    @triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
    def gather(x_ptr, slots_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        slot = tl.load(slots_ptr + tl.program_id(0))
        tl.store(out_ptr + i, tl.load(x_ptr + slot * BLOCK + i))


    x, out = torch.zeros(4, 64), torch.zeros(64)
    slots = torch.arange(8, dtype=torch.int64)
    gather.warmup(x, slots[0:4], out, BLOCK=64, grid=(4,))
    gather.warmup(x, slots[1:5], out, BLOCK=64, grid=(4,))  # 8 bytes off alignment
    gather.warmup(x[:, 1:], slots[0:4], out, BLOCK=64, grid=(4,))  # a data pointer: compiles
    print("compiles:", len(compiles))
    """
)


@pytest.mark.skipif(ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas")
def test_a_misaligned_index_slice_reuses_the_compiled_kernel(tmp_path: Path) -> None:
    script = tmp_path / "compile.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "compiles: 2" in done.stdout, done.stdout + done.stderr
