"""A tiny Qwen3.5 target and its MTP head trained on CPU, for tests/spec/test_mtp_trained.py.

The language: a key token k (one of KEYS) at position 0, a random start token, then
t_{p+1} = f_k(t_p) for one of KEYS random permutations f_k of the other tokens. Every token
after the start is determined, but only by the key AND the last token: the target must read
the key from the context, and the MTP head, which sees t_{p+1} (its embedding) and the
target's final hidden state h_p, must read the key from h_p (or from its own context) to
predict t_{p+2} = f_k(t_{p+1}).

The target is an HF Qwen3_5ForCausalLM (one GDN layer, one gated attention layer) trained on
the language; the head is then trained with the target frozen, its forward being the float32
reference of tests/spec/mtp_helpers.py with autograd: step 0 predicts t_{p+2} from
(t_{p+1}, h_p); step 1 of the chain predicts t_{p+3} from (t_{p+2}, the head's own output at
p), attending over the exact positions 0 .. p and itself, as the engine's chain does.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from mtp_helpers import MTPReference, add_mtp_head, mtp_tensors, text_config
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

VOCAB = 32
KEYS = 3  # key tokens 1 .. KEYS
FIRST = KEYS + 1  # permuted tokens FIRST .. VOCAB - 1
SEQ_LEN = 24
HIDDEN = 64
KV_BLOCK = 8


def permutations(seed: int = 0) -> torch.Tensor:
    """[KEYS + 1, VOCAB] next-token tables (row k for key k; row 0 unused)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.zeros(KEYS + 1, VOCAB, dtype=torch.long)
    n = VOCAB - FIRST
    for k in range(1, KEYS + 1):
        table[k, FIRST:] = torch.randperm(n, generator=gen) + FIRST
    return table


def language(n: int, length: int, gen: torch.Generator, table: torch.Tensor) -> torch.Tensor:
    """[n, length] sequences: key, start, then the key's permutation applied repeatedly."""
    x = torch.zeros(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(1, KEYS + 1, (n,), generator=gen)
    x[:, 1] = torch.randint(FIRST, VOCAB, (n,), generator=gen)
    for p in range(2, length):
        x[:, p] = table[x[:, 0], x[:, p - 1]]
    return x


def train_target(path: Path, gen: torch.Generator, table: torch.Tensor, max_steps: int = 300):
    """Train the tiny hybrid target until it predicts every determined token of a batch, save
    it (HF layout) to `path`; returns (the HF model, the number of steps)."""
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = Qwen3_5ForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    step = 0
    while step < max_steps:
        step += 1
        x = language(16, SEQ_LEN, gen, table)
        logits = model(x).logits[:, 1:-1]  # positions whose next token is determined
        y = x[:, 2:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05 and bool((logits.argmax(-1) == y).all()):
            break
    model.eval().requires_grad_(False).save_pretrained(path)
    return model, step


class ChainTraining(MTPReference):
    """The reference with a chain step for training: step 1 at position p + 1 reads
    (t_{p+2}, y0_p) and attends over the exact positions 0 .. p plus its own key."""

    def kv(self, x: torch.Tensor, pos: torch.Tensor):
        p, D, cfg = "mtp.layers.0.self_attn.", self.D, self.cfg
        L, hq, hkv = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        qg = (x @ self.w[p + "q_proj.weight"].T).reshape(L, hq, 2 * D)
        q = self.rope(self.norm(qg[..., :D], p + "q_norm.weight"), pos)
        k = (x @ self.w[p + "k_proj.weight"].T).reshape(L, hkv, D)
        k = self.rope(self.norm(k, p + "k_norm.weight"), pos).repeat_interleave(hq // hkv, 1)
        v = (x @ self.w[p + "v_proj.weight"].T).reshape(L, hkv, D).repeat_interleave(hq // hkv, 1)
        return q, qg[..., D:], k, v

    def layer(self, x: torch.Tensor, pos: torch.Tensor, ctx_kv=None) -> torch.Tensor:
        """x [L, H] at `pos`; without ctx_kv causal self-attention (step 0), else query i
        sees ctx keys 0 .. i and its own key (step 1). Returns (y, (k, v))."""
        p = "mtp.layers.0."
        h = self.norm(x, p + "input_layernorm.weight")
        q, gate, k, v = self.kv(h, pos)
        L = x.shape[0]
        scale = 1 / math.sqrt(self.D)
        if ctx_kv is None:
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", probs, v)
        else:
            ck, cv = ctx_kv
            s_ctx = torch.einsum("qhd,khd->hqk", q, ck) * scale  # [h, L, L]
            s_ctx = s_ctx.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
            s_own = (q * k).sum(-1).T[..., None] * scale  # [h, L, 1]
            probs = torch.cat([s_ctx, s_own], -1).softmax(-1)
            o = (
                torch.einsum("hqk,khd->qhd", probs[..., :L], cv)
                + probs[..., L:].permute(1, 0, 2) * v
            )
        o = (o * torch.sigmoid(gate)).reshape(L, -1) @ self.w[p + "self_attn.o_proj.weight"].T
        x = x + o
        x = x + self.ffn(self.norm(x, p + "post_attention_layernorm.weight"))
        return self.norm(x, "mtp.norm.weight"), (k, v)

    def fc_in(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.norm(self.embed[tokens], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden, "mtp.pre_fc_norm_hidden.weight")
        return torch.cat([e, h], dim=-1) @ self.w["mtp.fc.weight"].T


def train_head(hf_target, target_dir: Path, gen: torch.Generator, table, max_steps: int = 300):
    """Train the MTP head with the target frozen; write it into `target_dir`'s checkpoint.
    Returns (the weights, the number of steps)."""
    cfg = text_config(target_dir)
    data = language(128, SEQ_LEN, gen, table)
    with torch.no_grad():
        hidden = hf_target.model(data).last_hidden_state  # [n, T, H] after the final norm
    embed = hf_target.model.embed_tokens.weight
    lm_head = hf_target.lm_head.weight
    w = {k: v.clone().requires_grad_(True) for k, v in mtp_tensors(cfg, seed=1).items()}
    ref = ChainTraining(w, cfg, embed, lm_head)
    ref.w = w  # train these leaves
    opt = torch.optim.AdamW(list(w.values()), lr=3e-3, weight_decay=0.0)
    T = SEQ_LEN
    pos0 = torch.arange(T - 2)  # step 0 at positions 0 .. T - 3
    step = 0
    while step < max_steps:
        step += 1
        idx = torch.randint(0, data.shape[0], (8,), generator=gen)
        loss, right = 0.0, True
        for i in idx.tolist():
            x, h = data[i], hidden[i]
            y0, kv = ref.layer(ref.fc_in(x[1:-1], h[:-2]), pos0)  # predicts t_{p+2}
            l0 = ref.logits(y0)
            y1, _ = ref.layer(ref.fc_in(x[2:-1], y0[:-1]), pos0[:-1] + 1, (kv[0][:-1], kv[1][:-1]))
            l1 = ref.logits(y1)  # predicts t_{p+3}
            # the key's position and the start token's predictions are not determined
            loss = loss + F.cross_entropy(l0[1:], x[3:]) + F.cross_entropy(l1[1:], x[4:])
            right = right and bool((l0[1:].argmax(-1) == x[3:]).all())
            right = right and bool((l1[1:].argmax(-1) == x[4:]).all())
        loss = loss / len(idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05 and right:
            break
    weights = {k: v.detach() for k, v in w.items()}
    write_head(target_dir, weights)
    return weights, step


def write_head(target_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    f = sorted(Path(target_dir).glob("*.safetensors"))[0]
    tensors = load_file(f)
    tensors.update(weights)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(f), metadata={"format": "pt"})


__all__ = ["add_mtp_head", "language", "permutations", "train_head", "train_target"]
