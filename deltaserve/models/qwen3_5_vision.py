"""The Qwen3.5 vision tower (HF `Qwen3_5VisionModel`; Qwen3.5-MoE's is the same), math only.

pixel patches [N, C * Tp * P * P] (the image processor's `pixel_values`, patches of each image
in spatial-merge-block order) and `grid_thw` [num_images, 3] -> one embedding per merged token,
[sum(t * h * w / m^2), out_hidden]:

    x = patch_embed(patches) + bilinear(pos_embed grid, (h, w))      (align_corners, per patch)
    per block: x = x + proj(attn(rope2d(qkv(LN1(x)))))  (full, non-causal, per image frame)
               x = x + fc2(gelu_tanh(fc1(LN2(x))))
    merger: fc2(gelu(fc1(LN(x) viewed as groups of m^2 patches)))

The 2-D rotary rotates every channel of a head: its angle table is [h freqs | w freqs] of
`head_dim / 4` inverse frequencies each, NeoX halves. No window attention and no deep-stacked
features in Qwen3.5 (the language model receives only the merger's output). Checkpoint names
are HF's under `model.visual.` (the model maps them to `visual.`); the layers are plain torch
modules loaded by the common loader, replicated on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_lens: list[int]
    ) -> torch.Tensor:
        """x [S, dim]; cos, sin [S, head_dim] float32; seg_lens: attention segments (frames)."""
        S = x.shape[0]
        qkv = self.qkv(x).view(S, 3, self.num_heads, self.head_dim)  # [S, 3, H, D]
        q, k, v = qkv.unbind(1)  # [S, H, D] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        start = 0
        for n in seg_lens:  # NOTE: one SDPA per image frame (no attention across images)
            sl = slice(start, start + n)
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)
            )  # [H, n, D]
            out[sl] = o.transpose(0, 1)
            start += n
        return self.proj(out.reshape(S, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary over the whole head in float32: x [S, H, D], cos / sin [S, D]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, intermediate: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, intermediate)

    def forward(self, x, cos, sin, seg_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg_lens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = [Tp, P, P]) applied as one matmul over the
    flattened patches (the same channel-major layout the Conv3d's view reads)."""

    def __init__(self, in_channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(in_channels, dim, (temporal, patch, patch), (temporal, patch, patch))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight  # [dim, C, Tp, P, P]
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, dim: int, merge: int, out_dim: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.hidden)  # [S / m^2, m^2 * dim]: one merge block per row
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_5VisionTower(nn.Module):
    """The vision tower of an HF `Qwen3_5VisionConfig` (also Qwen3.5-MoE's)."""

    def __init__(self, vc) -> None:
        super().__init__()
        if vc.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {vc.hidden_act!r} is not supported")
        rope = getattr(vc, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope.get('rope_type')!r} is not supported")
        self.dim = vc.hidden_size
        self.num_heads = vc.num_heads
        self.head_dim = self.dim // self.num_heads
        self.merge = vc.spatial_merge_size
        self.out_hidden_size = vc.out_hidden_size
        self.patch_embed = PatchEmbed(
            vc.in_channels, vc.temporal_patch_size, vc.patch_size, self.dim
        )
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, self.dim)
        self.side = int(vc.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(
            VisionBlock(self.dim, self.num_heads, vc.intermediate_size) for _ in range(vc.depth)
        )
        self.merger = PatchMerger(self.dim, self.merge, vc.out_hidden_size)
        theta = float(rope.get("rope_theta", 10000.0))
        quarter = self.head_dim // 2
        self._inv_freq = 1.0 / theta ** (
            torch.arange(0, quarter, 2, dtype=torch.float32, device="cpu") / quarter
        )

    def num_tokens(self, grid_thw: list[int]) -> int:
        """Merged tokens (language-model embeddings) of one image of grid (t, h, w)."""
        t, h, w = grid_thw
        return t * h * w // (self.merge * self.merge)

    def _patch_rows_cols(self, grid: list[list[int]], device) -> tuple[torch.Tensor, ...]:
        """(row, col, height, width) of every patch [N], patches in merge-block order."""
        m = self.merge
        rows, cols, hs, ws = [], [], [], []
        for t, h, w in grid:
            r = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            c = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            # [h/m, m, w/m, m] -> block-major [h/m, w/m, m, m]
            rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
            cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
            hs.append(torch.full((t * h * w,), h, device=device))
            ws.append(torch.full((t * h * w,), w, device=device))
        return torch.cat(rows), torch.cat(cols), torch.cat(hs), torch.cat(ws)

    def _pos_embeds(self, row, col, hs, ws) -> torch.Tensor:
        """The learned side x side position grid resampled bilinearly (align_corners) to each
        image's (h, w) grid, at every patch [N, dim]."""
        side = self.side

        def taps(idx, size):
            src = idx.float() * (side - 1) / (size - 1).clamp(min=1).float()
            lo = src.floor()
            frac = src - lo
            lo = lo.long()
            return lo.clamp(0, side - 1), (lo + 1).clamp(0, side - 1), frac

        r0, r1, fr = taps(row, hs)
        c0, c1, fc = taps(col, ws)
        table = self.pos_embed.weight
        out = (
            table[r0 * side + c0] * ((1 - fr) * (1 - fc))[:, None]
            + table[r0 * side + c1] * ((1 - fr) * fc)[:, None]
            + table[r1 * side + c0] * (fr * (1 - fc))[:, None]
            + table[r1 * side + c1] * (fr * fc)[:, None]
        )
        return out

    def forward(self, patches: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """patches [N, C * Tp * P * P], grid_thw [[t, h, w], ...] -> [N / m^2, out_hidden]."""
        device = patches.device
        row, col, hs, ws = self._patch_rows_cols(grid_thw, device)
        if row.numel() != patches.shape[0]:
            raise ValueError(
                f"{patches.shape[0]} patches for grids {grid_thw} ({row.numel()} expected)"
            )
        x = self.patch_embed(patches)
        x = x + self._pos_embeds(row, col, hs, ws).to(x.dtype)
        inv = self._inv_freq.to(device)
        freqs = torch.cat((row[:, None] * inv, col[:, None] * inv), dim=-1)  # [N, D / 2]
        freqs = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        cos, sin = freqs.cos(), freqs.sin()
        seg_lens = [h * w for t, h, w in grid_thw for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, seg_lens)
        return self.merger(x)
