"""`FusedOps` on Triton kernels (CUDA, or Triton's interpreter on CPU under TRITON_INTERPRET=1).

Imported lazily by `deltaserve.ops.fused.load_fused_ops("triton")`: this module needs triton.
"""

from __future__ import annotations

from deltaserve.ops.fused import FusedOps
from deltaserve.ops.fused.activation import sigmoid_gate_mul, silu_and_mul
from deltaserve.ops.fused.argmax import row_argmax
from deltaserve.ops.fused.copy_rows import copy_rows
from deltaserve.ops.fused.gated_norm import gated_rms_norm
from deltaserve.ops.fused.mla_prep import mla_rope_norm
from deltaserve.ops.fused.rmsnorm import rms_norm
from deltaserve.ops.fused.rotary import qk_norm_rope


class TritonFusedOps(FusedOps):
    """Each op is one kernel launch; semantics as documented on `FusedOps`."""

    name = "triton"
    supports_cuda_graph = True  # grids from tensor shapes only; no host sync or metadata read

    rms_norm = staticmethod(rms_norm)
    gated_rms_norm = staticmethod(gated_rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    sigmoid_gate_mul = staticmethod(sigmoid_gate_mul)
    qk_norm_rope = staticmethod(qk_norm_rope)
    mla_rope_norm = staticmethod(mla_rope_norm)
    argmax = staticmethod(row_argmax)
    copy_rows = staticmethod(copy_rows)
