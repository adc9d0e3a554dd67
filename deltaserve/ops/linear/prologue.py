"""Decode GEMM prologues: the elementwise op before a projection, applied as its input is loaded.

At decode batch 1..16 the op before a layer's last projection is a kernel of its own that reads
and writes a few KB: the MLP's `silu(gate) * up` before down_proj, the GDN output norm
`w * norm(o) * silu(z)` (per value head) before out_proj, the gated attention's
`o * sigmoid(gate)` before o_proj. Each costs a launch and its latency per layer. A prologue
folds it into the decode GEMM: every program transforms the K tile of x it loads (x is read
from L2 by every column tile; the extra math is a few FMAs per element), so the op's kernel and
its output tensor disappear. The results are those of the op's own Triton
kernel (ops/fused: the same float32 math, rounded to x's dtype at the same points) followed by
the GEMM, bit for bit.

- `silu_mul`: x [M, 2K] = [gate | up]; the GEMM's input is silu(gate) * up [M, K].
- `gated_norm`: x = o [M, H * D] (D a power of two: each K tile of the kernels holds whole
  heads), z [M, H, D]; the input is `w * rmsnorm(o) * silu(z)` over each head of D.
- `sigmoid_mul`: x = o [M, H * D], gate [M, H, D]; the input is `o * sigmoid(gate)`.

z and gate are any views with a unit last stride (the gate half of Qwen3.5's per-head
[query | gate] projection has a head stride of 2D): the kernels address column k of x's row at
head k // D, offset k % D.

The kernels' side is ops/linear/triton_prologue.py (`load_x`); this module imports no Triton.
DELTASERVE_DECODE_GEMM_PROLOGUE=1 lets the layers hand their op to the Triton decode GEMM (off
by default until `bench throughput` has measured it on a GPU); the layers otherwise run the op's
kernel, then the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NONE, SILU_MUL, GATED_NORM, SIGMOID_MUL = 0, 1, 2, 3
KINDS = {"silu_mul": SILU_MUL, "gated_norm": GATED_NORM, "sigmoid_mul": SIGMOID_MUL}


@dataclass(frozen=True)
class DecodePrologue:
    """What a decode GEMM applies to its input x as it loads it (module docstring): its kind;
    z [M, H, D] (gated_norm: z; sigmoid_mul: the gate); the norm weight [D] and eps
    (gated_norm)."""

    kind: str
    z: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0

    @property
    def code(self) -> int:
        """The kernels' PROLOGUE constant."""
        return KINDS[self.kind]

    @property
    def head(self) -> int:
        """D, the head size of z (1 without z)."""
        return self.z.shape[-1] if self.z is not None else 1


def silu_mul() -> DecodePrologue:
    return DecodePrologue("silu_mul")


def gated_norm(z: torch.Tensor, weight: torch.Tensor, eps: float) -> DecodePrologue:
    """z [M, H, D]; weight [D]."""
    return DecodePrologue("gated_norm", z, weight, eps)


def sigmoid_mul(gate: torch.Tensor) -> DecodePrologue:
    """gate [M, H, D]."""
    return DecodePrologue("sigmoid_mul", gate)


def gated_norm_fits(head_dim: int) -> bool:
    """Whether heads of `head_dim` can take the gated_norm prologue (a power of two: the
    kernels' K tiles hold whole heads)."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def gemm_in_features(x: torch.Tensor, prologue: DecodePrologue | None) -> int:
    """K, the GEMM's input features, of x under `prologue` (x's columns halve for silu_mul)."""
    return x.shape[1] // 2 if prologue is not None and prologue.kind == "silu_mul" else x.shape[1]


def check_prologue(x: torch.Tensor, prologue: DecodePrologue | None) -> None:
    """ValueError naming what does not fit: x [M, *] and the prologue's tensors."""
    if prologue is None:
        return
    if prologue.kind not in KINDS:
        raise ValueError(f"unknown decode GEMM prologue {prologue.kind!r}; one of {list(KINDS)}")
    if prologue.kind == "silu_mul":
        if x.shape[1] % 2:
            raise ValueError(f"silu_mul needs an even number of input columns, got {x.shape[1]}")
        return
    z, w = prologue.z, prologue.norm_weight
    if z is None or (prologue.kind == "gated_norm" and w is None):
        what = "z and the norm weight" if prologue.kind == "gated_norm" else "the gate"
        raise ValueError(f"the {prologue.kind} prologue needs {what}")
    if z.dim() != 3 or z.shape[0] != x.shape[0] or z.shape[1] * z.shape[2] != x.shape[1]:
        raise ValueError(
            f"{prologue.kind}: z {tuple(z.shape)} must be [M, H, D] with M = {x.shape[0]} and "
            f"H * D = {x.shape[1]}"
        )
    if z.stride(-1) != 1 or z.dtype != x.dtype:
        raise ValueError(f"{prologue.kind}: z needs a unit last stride and x's dtype {x.dtype}")
    if prologue.kind == "gated_norm":
        d = z.shape[2]
        if not gated_norm_fits(d) or tuple(w.shape) != (d,) or not w.is_contiguous():
            raise ValueError(
                f"gated_norm: heads of a power-of-two size with a contiguous norm weight of "
                f"that size, got heads of {d} and a weight {tuple(w.shape)}"
            )


def reference(x: torch.Tensor, prologue: DecodePrologue | None) -> torch.Tensor:
    """The prologue in PyTorch: x -> the GEMM's input (ops/fused/reference.py's math)."""
    if prologue is None:
        return x
    if prologue.kind == "silu_mul":
        d = x.shape[1] // 2
        return F.silu(x[:, :d]) * x[:, d:]
    z = prologue.z
    if prologue.kind == "sigmoid_mul":
        return (x.view(z.shape) * torch.sigmoid(z)).reshape(x.shape)
    xf = x.float().reshape(z.shape)  # [M, H, D]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + prologue.eps)
    y = (prologue.norm_weight.float() * xf.to(x.dtype).float()).to(x.dtype)
    return (y * F.silu(z.float())).to(x.dtype).reshape(x.shape)


def kernel_args(x: torch.Tensor, prologue: DecodePrologue | None) -> dict:
    """The prologue's kernel arguments (dummies where unused: never read)."""
    code = NONE if prologue is None else prologue.code
    if prologue is None or prologue.z is None:
        return dict(z_ptr=x, nw_ptr=x, stride_zm=0, stride_zh=0, eps=0.0, PROLOGUE=code, HEAD=1)
    z = prologue.z
    nw = prologue.norm_weight if prologue.norm_weight is not None else x
    return dict(
        z_ptr=z,
        nw_ptr=nw,
        stride_zm=z.stride(0),
        stride_zh=z.stride(1),
        eps=float(prologue.eps),
        PROLOGUE=code,
        HEAD=prologue.head,
    )


def min_block_k(prologue: DecodePrologue | None) -> int:
    """The smallest K tile the prologue allows (a gated_norm tile holds whole heads)."""
    return prologue.head if prologue is not None and prologue.kind == "gated_norm" else 1
