"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints
(`mtp.*`): math only. HF transformers ignores these weights; deltaserve.spec.mtp drafts with
them (speculative method "mtp").

For a position p whose target hidden state h_p (AFTER the target's final norm) and next token
t_{p+1} are known:

    x = fc(cat[pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)])   # embedding first
    y = mtp.norm(layer(x))            # one full-attention decoder layer of the target's kind
    logits(t_{p+2}) = target lm_head(y)

The layer attends over its own paged KV cache at positions 0 .. p (its `self_attn` is the
target's gated `Attention` with layer index 0: `ctx.caches[0]` is the MTP layer's cache). A
chained draft feeds `y` back as the next position's hidden state, with the drafted token.

Checkpoint names (the released layout): `mtp.fc.weight [H, 2H]` (no bias),
`mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight`
(zero-centred `(1 + w)` RMSNorms) and `mtp.layers.0.*` named as a target decoder layer
(`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`,
`post_attention_layernorm`, `mlp.*` dense or MoE); the target's packed modules and weight rules
apply to them unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.forward_context import ForwardContext
from deltaserve.layers.norms import RMSNorm


class MTPHead(nn.Module):
    """fc over [normed embedding | normed target hidden], one decoder layer, a final norm."""

    def __init__(self, hidden_size: int, rms_norm_eps: float, layer: nn.Module) -> None:
        super().__init__()
        H = hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, rms_norm_eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H, rms_norm_eps, zero_centered=True)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(H, rms_norm_eps, zero_centered=True)

    @property
    def layer(self) -> nn.Module:
        return self.layers[0]

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """embeds [T, H] (the target's embeddings of t_{p+1}), hidden [T, H] (h_p, final-normed),
        positions [T] (p) -> the MTP output y [T, H] (normed by `mtp.norm`). The layer writes
        its K / V of these positions into `ctx.caches[0]` (slots of `ctx.meta`)."""
        ops = ctx.kernels.fused
        e, h = self.pre_fc_norm_embedding, self.pre_fc_norm_hidden
        x = torch.cat(
            [
                ops.rms_norm(embeds, e.weight, e.eps, e.zero_centered),
                ops.rms_norm(hidden.to(embeds.dtype), h.weight, h.eps, h.zero_centered),
            ],
            dim=-1,
        )  # [T, 2H], embedding first
        x, residual = self.layer(positions, self.fc(x), None, ctx)
        n = self.norm
        y, _ = ops.rms_norm(x, n.weight, n.eps, n.zero_centered, residual=residual)
        return y


def num_mtp_layers(config) -> int:
    """MTP layers an HF text config declares (`mtp_num_hidden_layers` for Qwen3.5,
    `num_nextn_predict_layers` for Qwen3-Next; 1 when neither is set)."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    return 1
