"""MTP heads for the tiny test checkpoints, and a plain float32 reference of the MTP math.

`add_mtp_head` writes random `mtp.*` tensors into a tiny checkpoint (tests/hf_models.py) in the
released layout: `mtp.fc.weight [H, 2H]`, the three zero-centred norms, `mtp.layers.0.*` named as
a target decoder layer (gated attention with q/k norms; a dense MLP, or the MoE block with
shared expert: per-expert `experts.{e}.{gate,up,down}_proj.weight` or fused
`experts.gate_up_proj` / `experts.down_proj`). HF transformers has no MTP implementation, so
`MTPReference` writes the math out (dense attention over a whole sequence, float32).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def text_config(model_dir: Path) -> dict[str, Any]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def _head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _is_moe(cfg: dict[str, Any]) -> bool:
    if not cfg.get("num_experts"):
        return False
    # Qwen3-Next: layer 0 is sparse unless listed in mlp_only_layers (decoder_sparse_step | 1)
    step = cfg.get("decoder_sparse_step", 1)
    return 0 not in (cfg.get("mlp_only_layers") or []) and 1 % step == 0


def mtp_tensors(cfg: dict[str, Any], seed: int, fused: bool = False) -> dict[str, torch.Tensor]:
    """Every `mtp.*` tensor of a head for text config `cfg`, random (norm weights around 0:
    zero-centred, so a missing `1 + w` shows)."""
    gen = torch.Generator().manual_seed(seed)
    H, D = cfg["hidden_size"], _head_dim(cfg)
    hq, hkv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D

    def mat(*shape: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * gain * shape[-1] ** -0.5

    def norm(n: int) -> torch.Tensor:
        return 0.2 * torch.randn(n, generator=gen)

    p = "mtp.layers.0."
    w = {
        "mtp.fc.weight": mat(H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": norm(H),
        "mtp.pre_fc_norm_hidden.weight": norm(H),
        "mtp.norm.weight": norm(H),
        p + "input_layernorm.weight": norm(H),
        p + "post_attention_layernorm.weight": norm(H),
        p + "self_attn.q_proj.weight": mat(2 * hq, H),  # per head [query | gate]
        p + "self_attn.k_proj.weight": mat(hkv, H),
        p + "self_attn.v_proj.weight": mat(hkv, H),
        p + "self_attn.o_proj.weight": mat(H, hq),
        p + "self_attn.q_norm.weight": norm(D),
        p + "self_attn.k_norm.weight": norm(D),
    }
    if not _is_moe(cfg):
        inter = cfg["intermediate_size"]
        w[p + "mlp.gate_proj.weight"] = mat(inter, H)
        w[p + "mlp.up_proj.weight"] = mat(inter, H)
        w[p + "mlp.down_proj.weight"] = mat(H, inter)
        return w
    E, inter, shared = (
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
        cfg["shared_expert_intermediate_size"],
    )
    w[p + "mlp.gate.weight"] = mat(E, H, gain=4.0)
    w[p + "mlp.shared_expert.gate_proj.weight"] = mat(shared, H)
    w[p + "mlp.shared_expert.up_proj.weight"] = mat(shared, H)
    w[p + "mlp.shared_expert.down_proj.weight"] = mat(H, shared)
    w[p + "mlp.shared_expert_gate.weight"] = mat(1, H)
    gate, up, down = mat(E, inter, H), mat(E, inter, H), mat(E, H, inter)
    if fused:
        w[p + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
        w[p + "mlp.experts.down_proj"] = down  # [E, H, I]
    else:
        for e in range(E):
            w[p + f"mlp.experts.{e}.gate_proj.weight"] = gate[e]
            w[p + f"mlp.experts.{e}.up_proj.weight"] = up[e]
            w[p + f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return w


def add_mtp_head(model_dir: Path, seed: int = 0, fused: bool = False) -> dict[str, torch.Tensor]:
    """Write a random MTP head into the checkpoint at `model_dir` (its first safetensors file,
    the index updated when there is one); returns the tensors (float32)."""
    model_dir = Path(model_dir)
    w = mtp_tensors(text_config(model_dir), seed, fused)
    f = sorted(model_dir.glob("*.safetensors"))[0]
    tensors = load_file(f)
    dtype = next(iter(tensors.values())).dtype
    tensors.update({k: v.to(dtype) for k, v in w.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(f), metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: f.name for k in w})
        index.write_text(json.dumps(data, indent=2))
    return {k: v.to(dtype).float() for k, v in w.items()}


class MTPReference:
    """The MTP head's math in float32, over a whole sequence with dense causal attention.

    `forward(next_tokens [L], hidden [L, H])`: position p (0-based) reads t_{p+1} and the
    target's final-normed h_p; returns y [L, H] (after mtp.norm). `logits(y)` applies the
    target's lm_head."""

    def __init__(self, w: dict[str, torch.Tensor], cfg: dict[str, Any], embed, lm_head) -> None:
        self.w = {k: v.float() for k, v in w.items()}
        self.cfg = cfg
        self.embed = embed.float()
        self.lm_head = lm_head.float()
        self.D = _head_dim(cfg)
        rope = cfg.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        self.rot = int(self.D * factor)
        self.theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        self.eps = cfg["rms_norm_eps"]

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Zero-centred RMSNorm: x / rms(x) * (1 + w)."""
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.w[name])

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """NeoX rotary on the first `rot` dims of x [L, heads, D]."""
        half = self.rot // 2
        inv = 1.0 / self.theta ** (torch.arange(half, dtype=torch.float64) * 2 / self.rot)
        f = pos.double()[:, None] * inv[None]  # [L, half]
        cos, sin = f.cos().float()[:, None], f.sin().float()[:, None]
        x1, x2, rest = x[..., :half], x[..., half : self.rot], x[..., self.rot :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    def attention(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        p, D, cfg = "mtp.layers.0.self_attn.", self.D, self.cfg
        L, hq, hkv = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        qg = (x @ self.w[p + "q_proj.weight"].T).reshape(L, hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = (x @ self.w[p + "k_proj.weight"].T).reshape(L, hkv, D)
        v = (x @ self.w[p + "v_proj.weight"].T).reshape(L, hkv, D)
        q = self.rope(self.norm(q, p + "q_norm.weight"), pos)
        k = self.rope(self.norm(k, p + "k_norm.weight"), pos)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", probs, v) * torch.sigmoid(gate)
        return o.reshape(L, hq * D) @ self.w[p + "o_proj.weight"].T

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        p, w, cfg = "mtp.layers.0.mlp.", self.w, self.cfg
        if p + "gate_proj.weight" in w:  # dense
            return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[
                p + "down_proj.weight"
            ].T
        E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
        if p + "experts.gate_up_proj" in w:
            gate_up, down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]
        else:
            gate_up = torch.stack(
                [
                    torch.cat(
                        [w[f"{p}experts.{e}.gate_proj.weight"], w[f"{p}experts.{e}.up_proj.weight"]]
                    )
                    for e in range(E)
                ]
            )
            down = torch.stack([w[p + f"experts.{e}.down_proj.weight"] for e in range(E)])
        probs = (x @ w[p + "gate.weight"].T).softmax(-1)
        top, idx = probs.topk(k, dim=-1)
        if cfg.get("norm_topk_prob", True):
            top = top / top.sum(-1, keepdim=True)
        mix = torch.zeros(x.shape[0], E).scatter(1, idx, top)  # [T, E] routing weights
        inter = gate_up.shape[1] // 2
        gu = torch.einsum("eih,th->tei", gate_up, x)  # every expert on every token: [T, E, 2I]
        act = F.silu(gu[..., :inter]) * gu[..., inter:]
        out = torch.einsum("ehi,tei,te->th", down, act, mix)
        s = "shared_expert."
        shared = (
            F.silu(x @ w[p + s + "gate_proj.weight"].T) * (x @ w[p + s + "up_proj.weight"].T)
        ) @ w[p + s + "down_proj.weight"].T
        return out + torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * shared

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.norm(self.embed[next_tokens], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden, "mtp.pre_fc_norm_hidden.weight")
        x = torch.cat([e, h], dim=-1) @ self.w["mtp.fc.weight"].T  # embedding first
        pos = torch.arange(x.shape[0])
        x = x + self.attention(self.norm(x, "mtp.layers.0.input_layernorm.weight"), pos)
        x = x + self.ffn(self.norm(x, "mtp.layers.0.post_attention_layernorm.weight"))
        return self.norm(x, "mtp.norm.weight")

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        return y @ self.lm_head.T

    def chain(
        self, next_tokens: torch.Tensor, hidden: torch.Tensor, k: int
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy chain: positions 0 .. n - 1 have (t_{p+1}, h_p) (the last one is the step-0
        input); k drafts, each from the previous step's argmax and output. Returns (drafts,
        logits [k, vocab])."""
        toks, hs = next_tokens.clone(), hidden.float().clone()
        drafts, logits = [], []
        for _ in range(k):
            y = self.forward(toks, hs)[-1]
            lg = self.logits(y)
            tok = int(lg.argmax())
            drafts.append(tok)
            logits.append(lg)
            toks = torch.cat([toks, torch.tensor([tok])])
            hs = torch.cat([hs, y[None]])
        return drafts, torch.stack(logits)
