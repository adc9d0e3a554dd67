"""A dense float32 reference of the DFlash drafter's math, for one sequence at a time.

Written from the checkpoint tensors directly (z-lab names, `layers.N.self_attn.q_proj.weight`,
...), with plain torch ops and no engine code (no paged cache, no fused ops, no loader), so
that the engine's drafter (deltaserve/spec/dflash/drafter.py) can be checked against it. It
follows z-lab's `DFlashDraftModel` (dflash/model.py):

    c = hidden_norm(fc(concat(taps)))                      # per context position
    for each layer: K_ctx = rope(k_norm(k_proj(c))), V_ctx = v_proj(c)   (cached, once)
    x = embed([last, MASK, ..., MASK]) * input_embedding_scale          # block of L
    for each layer:
        h = input_layernorm(x)
        q, k, v = q_norm(q_proj(h)), k_norm(k_proj(h)), v_proj(h)  (+ rope on q, k)
        o = softmax(q [K_ctx | k]^T * scale + mask) [V_ctx | v]      # mask: z-lab's rules
        x = x + o_proj(o); x = x + mlp(post_attention_layernorm(x))
    logits_i = lm_head(norm(x)[i + 1]) * output_multiplier (then softcap), i = 0 .. L - 2

Its autograd-friendly pieces (`rms_norm`, `rope`, `layer_block`) are also what the tests'
drafter training uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.spec.dflash.config import DFlashConfig

Weights = dict[str, torch.Tensor]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm, `w * x / rms(x)` over the last dim (plain weight, not 1 + w)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, cfg: DFlashConfig) -> torch.Tensor:
    """NeoX rotary of x [..., N, heads, D] at positions [..., N] on the first rotary_dim
    channels."""
    D = x.shape[-1]
    rd = int(D * cfg.partial_rotary_factor)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    ang = positions.float()[..., None] * inv  # [..., N, rd / 2]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]  # [..., N, 1, rd / 2]
    x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:]], dim=-1)


def visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """[Lq, Lk] bool, z-lab's `_attention_mask` over absolute positions."""
    qp, kp = q_pos[:, None], k_pos[None, :]
    vis = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool)
    if causal:
        vis &= kp <= qp
    if window is not None:
        vis &= qp - kp < window
        if not causal:
            vis &= kp - qp < window
    return vis


def _linear(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def context_features(w: Weights, cfg: DFlashConfig, taps: torch.Tensor) -> torch.Tensor:
    """taps [..., N, n_taps, H] -> c [..., N, H] = hidden_norm(fc(concat(taps)))."""
    flat = taps.flatten(-2).float()  # [..., N, n_taps * H]
    return rms_norm(F.linear(flat, w["fc.weight"]), w["hidden_norm.weight"], cfg.rms_norm_eps)


def context_kv(
    w: Weights, cfg: DFlashConfig, i: int, c: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's K, V [..., N, Hkv, D] of context features c [..., N, H] (no
    input_layernorm)."""
    p, D = f"layers.{i}.self_attn.", cfg.head_dim
    heads = c.shape[:-1] + (-1, D)
    k = _linear(c, w, p + "k_proj").reshape(heads)
    v = _linear(c, w, p + "v_proj").reshape(heads)
    k = rope(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), positions, cfg)
    return k, v


def layer_block(
    w: Weights,
    cfg: DFlashConfig,
    i: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """One draft layer over block stream x [..., L, H] at positions [..., L]: attention to
    the keys [ctx_k | block k] (ctx [..., S, Hkv, D]) under `mask` [..., L, S + L] bool, then
    the MLP. (A leading batch dimension is for the tests' drafter training.)"""
    p, D, eps = f"layers.{i}.", cfg.head_dim, cfg.rms_norm_eps
    heads = x.shape[:-1] + (-1, D)
    h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q = _linear(h, w, p + "self_attn.q_proj").reshape(heads)  # [..., L, Hq, D]
    k = _linear(h, w, p + "self_attn.k_proj").reshape(heads)  # [..., L, Hkv, D]
    v = _linear(h, w, p + "self_attn.v_proj").reshape(heads)
    q = rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], eps), positions, cfg)
    k = rope(rms_norm(k, w[p + "self_attn.k_norm.weight"], eps), positions, cfg)
    keys = torch.cat([ctx_k, k], dim=-3)  # [..., S + L, Hkv, D]
    values = torch.cat([ctx_v, v], dim=-3)
    group = q.shape[-2] // keys.shape[-2]
    keys = keys.repeat_interleave(group, dim=-2)  # [..., S + L, Hq, D]
    values = values.repeat_interleave(group, dim=-2)
    scores = torch.einsum("...lhd,...shd->...hls", q, keys) * D**-0.5  # [..., Hq, L, S + L]
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    o = torch.einsum("...hls,...shd->...lhd", torch.softmax(scores, dim=-1), values)
    o = o.flatten(-2)  # [..., L, Hq * D]
    x = x + _linear(o, w, p + "self_attn.o_proj")
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = _linear(h, w, p + "mlp.gate_proj"), _linear(h, w, p + "mlp.up_proj")
    return x + _linear(F.silu(gate) * up, w, p + "mlp.down_proj")


class DenseDrafter:
    """The reference drafter for ONE sequence: dense per-layer context K / V lists.

    Args:
        weights: checkpoint tensors by z-lab name (converted to float32 here).
        cfg: the drafter's config.
        embed_weight: the target's embedding table [V, H].
        lm_head_weight: the target's lm_head [V, H] (the embedding when tied).
    """

    def __init__(
        self,
        weights: Weights,
        cfg: DFlashConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
    ) -> None:
        self.w = {name: t.float() for name, t in weights.items()}
        self.cfg = cfg
        self.embed_weight = embed_weight.float()
        self.lm_head_weight = lm_head_weight.float()
        empty = torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim)
        self.ctx_k = [empty] * cfg.num_hidden_layers  # per layer [ctx_len, Hkv, D]
        self.ctx_v = [empty] * cfg.num_hidden_layers
        self.ctx_len = 0

    @torch.no_grad()
    def add_context(self, taps: torch.Tensor) -> None:
        """Append taps [n, n_taps, H] of the next n positions (ctx_len .. ctx_len + n - 1)."""
        n = taps.shape[0]
        positions = torch.arange(self.ctx_len, self.ctx_len + n)
        c = context_features(self.w, self.cfg, taps)
        for i in range(self.cfg.num_hidden_layers):
            k, v = context_kv(self.w, self.cfg, i, c, positions)
            self.ctx_k[i] = torch.cat([self.ctx_k[i], k])
            self.ctx_v[i] = torch.cat([self.ctx_v[i], v])
        self.ctx_len += n

    @torch.no_grad()
    def block_hidden(self, last_token: int, num_drafts: int) -> torch.Tensor:
        """Final-normed hidden states [1 + k, H] of the block [last, MASK x k]."""
        cfg, L = self.cfg, num_drafts + 1
        ids = torch.tensor([last_token] + [cfg.mask_token_id] * num_drafts)
        x = F.embedding(ids, self.embed_weight) * cfg.input_embedding_scale
        positions = torch.arange(self.ctx_len, self.ctx_len + L)
        all_pos = torch.arange(self.ctx_len + L)
        for i in range(cfg.num_hidden_layers):
            mask = visible(positions, all_pos, cfg.layer_causal(i), cfg.layer_window(i))
            x = layer_block(self.w, cfg, i, x, positions, self.ctx_k[i], self.ctx_v[i], mask)
        return rms_norm(x, self.w["norm.weight"], cfg.rms_norm_eps)

    @torch.no_grad()
    def draft_logits(self, last_token: int, num_drafts: int) -> torch.Tensor:
        """[k, V] logits of drafts 0 .. k - 1 (block positions 1 .. k)."""
        hidden = self.block_hidden(last_token, num_drafts)[1:]
        logits = F.linear(hidden, self.lm_head_weight) * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
