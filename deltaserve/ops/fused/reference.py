"""Torch references of the fused elementwise ops, bit-for-bit the math of `deltaserve.layers`.

Statistics and transcendental functions run in float32; every intermediate that the layer code
rounds to the activation dtype (e.g. `w * norm(x).to(dtype)`, `silu(gate)` in bf16) is rounded
here at the same place, so that swapping a layer's code for one of these changes no bit. The
Triton kernels round at the same places too; they differ from these only by float32 reduction
order and the last ulp of exp / rsqrt.

In-place semantics are the same as the Triton kernels' (see `deltaserve.ops.fused.FusedOps`):
`residual` is overwritten with `x + residual`; `out` / `q_out` / `k_out`, when given, receive the
result (they may alias the input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_out(out: torch.Tensor | None, like: torch.Tensor, name: str = "out") -> None:
    if out is not None and (out.shape != like.shape or out.dtype != like.dtype):
        raise ValueError(
            f"{name} is {tuple(out.shape)} {out.dtype}, expected {tuple(like.shape)} {like.dtype}"
        )


def _emit(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """norm(x) * w (or * (1 + w)) with float32 statistics, the output in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    # the layer computes `weight * xf.to(x.dtype)`: equal to this when weight has x's dtype
    # (a product of two bf16 / fp16 values is exact in float32)
    return (weight.float() * xf.to(x.dtype).float()).to(x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., N]; `norm(r) * w` or `norm(r) * (1 + w)`.

    Without `residual`, r = x and the normed tensor is returned. With `residual` (x's shape and
    dtype), r = x + residual rounded to x's dtype (the unfused `x = x + mixer(...)`); r is
    written into `residual` in place and `(normed, residual)` is returned.
    """
    _check_out(out, x)
    if residual is None:
        return _emit(_norm(x, weight, eps, zero_centered), out)
    _check_out(residual, x, "residual")
    r = x + residual
    y = _norm(r, weight, eps, zero_centered)
    residual.copy_(r)
    return _emit(y, out), residual


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`w * norm(x) * silu(z)` over the last dim of x, z [..., N] (the GDN output norm)."""
    _check_out(out, x)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight.float() * xf.to(x.dtype).float()).to(x.dtype)
    return _emit((y * F.silu(z.float())).to(x.dtype), out)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> silu(gate) * up [..., d].

    silu(gate) is rounded to x's dtype before the product, as the layer's bf16 code does.
    """
    d = x.shape[-1] // 2
    y = F.silu(x[..., :d]) * x[..., d:]
    _check_out(out, y)
    return _emit(y, out)


def sigmoid_gate_mul(
    o: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """o * sigmoid(gate) (Qwen3.5 gated attention output); sigmoid rounded to gate's dtype."""
    if o.shape != gate.shape:
        raise ValueError(f"o {tuple(o.shape)} and gate {tuple(gate.shape)} differ in shape")
    _check_out(out, o)
    return _emit(o * torch.sigmoid(gate), out)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary on the first 2 * cos.shape[-1] channels of x [T, H, D]
    (layers.rotary.RotaryEmbedding.apply); cos, sin [T, rotary_dim / 2] float32."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    rot = x[..., :rotary_dim].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then partial NeoX rotary of q [T, Hq, D] and k [T, Hk, D].

    cos, sin [T, rotary_dim / 2] float32 (`RotaryEmbedding.cos_sin(positions)`).
    """
    _check_out(q_out, q, "q_out")
    _check_out(k_out, k, "k_out")
    q2 = apply_rotary(_norm(q, q_weight, eps, zero_centered), cos, sin)
    k2 = apply_rotary(_norm(k, k_weight, eps, zero_centered), cos, sin)
    return _emit(q2, q_out), _emit(k2, k_out)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., d] with cos / sin [T, d / 2]: pairs (x[2i], x[2i + 1]) rotated by angle i, in
    float32, returned in x's dtype (the layout stays interleaved; DeepSeek-V2's rotary)."""
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], -1, 2)  # [T, ..., d / 2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    extra = (1,) * (x.dim() - 2)
    c = cos.view(cos.shape[0], *extra, cos.shape[1])  # [T, 1.., d / 2]
    s = sin.view(sin.shape[0], *extra, sin.shape[1])
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)  # [T, ..., d / 2, 2]
    return out.reshape(shape).to(x.dtype)


def mla_rope_norm(
    q_pe: torch.Tensor,
    kv_a: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    q_pe_out: torch.Tensor | None = None,
    latent_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's step preparation: q_pe [T, H, P] rotated (interleaved pairs), and the latent rows
    [T, R + P] = `[rms_norm(c_kv) * w | rotated k_pe]` of kv_a [T, R + P] = `[c_kv | k_pe]`."""
    P = q_pe.shape[-1]
    R = kv_a.shape[-1] - P
    q2 = apply_interleaved_rotary(q_pe, cos, sin)
    latent = torch.cat(
        (_norm(kv_a[:, :R], weight, eps, False), apply_interleaved_rotary(kv_a[:, R:], cos, sin)),
        dim=-1,
    )  # [T, R + P]
    _check_out(q_pe_out, q_pe, "q_pe_out")
    _check_out(latent_out, latent, "latent_out")
    return _emit(q2, q_pe_out), _emit(latent, latent_out)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> [R] int64: the index of each row's first maximum."""
    return x.argmax(dim=-1)


def copy_rows(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """`t[dst[i]] = t[src[i]]` in every tensor t for every i (independent copies)."""
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))
