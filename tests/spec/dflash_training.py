"""A tiny target and a tiny DFlash drafter trained on CPU, and greedy speculative decoding with
them, for the trained-drafter test (tests/spec/test_dflash_trained.py).

The language: a random segment of PERIOD tokens, repeated. After the first period every token
is determined by the context (t[p] = t[p - PERIOD]) and not by the last token alone, so a
drafter can only draft well by reading the target's hidden states of the context.

The target is an HF Qwen3ForCausalLM trained on the language (then loaded into deltaserve).
The drafter is trained with z-lab's recipe: random anchors a in each training sequence, block
[t[a], MASK x (B - 1)] at positions a .. a + B - 1, context visible only before the anchor
(the target's tapped hidden states at positions < a), same-position labels (block position k
predicts t[a + k]) weighted by exp(-(k - 1) / gamma). Its forward is the dense reference's
(deltaserve/spec/dflash/reference.py), batched, with autograd.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from deltaserve.cache.planner import CachePlan
from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels
from deltaserve.loader.hf_config import load_hf_config
from deltaserve.loader.weights import build_model, load_weights
from deltaserve.models.registry import get_model_class
from deltaserve.ops.attention.reference import TorchAttentionBackend
from deltaserve.spec.dflash.config import parse_dflash_config
from deltaserve.spec.dflash.proposer import DFlashProposer
from deltaserve.spec.dflash.reference import (
    context_features,
    context_kv,
    layer_block,
    rms_norm,
)
from deltaserve.spec.proposer import ComputedRow, TargetStep

VOCAB = 32
MASK_ID = VOCAB - 1
PERIOD = 11
SEQ_LEN = 36
HIDDEN = 64
BLOCK = 8
GAMMA = 4.0
TAPS = [0]
KV_BLOCK = 16


def language(n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[n, length] sequences: a random segment of PERIOD tokens (ids 1 .. VOCAB - 2) repeated."""
    seg = torch.randint(1, VOCAB - 1, (n, PERIOD), generator=gen)
    reps = math.ceil(length / PERIOD)
    return seg.repeat(1, reps)[:, :length]


def train_target(path: Path, gen: torch.Generator, max_steps: int = 400):
    """Train a 2-layer Qwen3 on the language until it predicts every determined token of a
    batch (deterministic: seeded data and init), save it (HF layout) to `path`; returns the
    (the HF model, the number of steps)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    step = 0
    while step < max_steps:
        step += 1
        x = language(16, SEQ_LEN, gen)
        logits = model(x).logits[:, PERIOD - 1 : -1]  # positions whose next token is determined
        y = x[:, PERIOD:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05 and bool((logits.argmax(-1) == y).all()):
            break
    model.eval().requires_grad_(False).save_pretrained(path)
    return model, step


def load_target(path: Path):
    """The trained target as a deltaserve model (float32, CPU)."""
    hf, text, arch = load_hf_config(path)
    model = build_model(get_model_class(arch), text, False, torch.float32, "cpu")
    load_weights(model, path)
    return model


class TargetRunner:
    """Our target on one sequence over a paged KV cache (reference kernels): forwards of any
    tokens at any positions; a rejected position is simply overwritten later."""

    def __init__(self, model, num_blocks: int = 16) -> None:
        self.model = model
        self.caches = []
        for s in model.layer_specs():
            shape = (num_blocks, KV_BLOCK, s.num_kv_heads, s.head_dim)
            self.caches.append({"k_cache": torch.zeros(shape), "v_cache": torch.zeros(shape)})
        self.block_ids = list(range(1, num_blocks))
        self.kernels = Kernels(attention=TorchAttentionBackend())

    @torch.inference_mode()
    def forward(self, ids: list[int], start: int, taps: tuple[int, ...]):
        """(argmax of every position [n], hidden states of `taps`) of `ids` at start .."""
        end = start + len(ids)
        pos = list(range(start, end))
        meta = BatchMetadata(
            slot_mapping=torch.tensor(
                [self.block_ids[p // KV_BLOCK] * KV_BLOCK + p % KV_BLOCK for p in pos]
            ),
            query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            context_lens=torch.tensor([start], dtype=torch.int32),
            block_tables=torch.tensor([self.block_ids], dtype=torch.int32),
            state_slots=torch.tensor([0]),
            has_initial_state=torch.tensor([start > 0]),
            query_start_loc_cpu=[0, len(ids)],
            seq_lens_cpu=[end],
            context_lens_cpu=[start],
            state_slots_cpu=[0],
        )
        ctx = ForwardContext(
            meta=meta, caches=self.caches, kernels=self.kernels, hidden_layers=taps
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), ctx)
        return self.model.compute_logits(hidden).argmax(-1), ctx.hidden_states


@torch.no_grad()
def hf_taps(hf_target, x: torch.Tensor) -> torch.Tensor:
    """[n, T, n_taps, H] tapped hidden states over sequences x [n, T], from HF's
    `output_hidden_states` (index i + 1 is layer i's output, pre-norm for i < L - 1)."""
    assert max(TAPS) < hf_target.config.num_hidden_layers - 1  # the last entry is normed
    hs = hf_target(x, output_hidden_states=True).hidden_states
    return torch.stack([hs[i + 1] for i in TAPS], dim=2)


def drafter_raw_config(num_layers: int = 2) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "vocab_size": VOCAB,
        "num_target_layers": 2,
        "dflash_config": {"block_size": BLOCK, "mask_token_id": MASK_ID, "target_layer_ids": TAPS},
    }


def train_drafter(
    hf_target, raw: dict, gen: torch.Generator, max_steps: int = 400, anchors: int = 4
):
    """Train the drafter of config `raw` on the language, reading the target's taps, until it
    drafts every block position of a batch right; returns (its weights by z-lab name, the
    number of steps)."""
    cfg = parse_dflash_config(raw)
    data = language(256, SEQ_LEN, gen)
    taps = hf_taps(hf_target, data)  # [n, T, n_taps, H]
    embed = hf_target.model.embed_tokens.weight
    head = hf_target.lm_head.weight
    torch.manual_seed(1)
    from dflash_helpers import random_drafter_weights

    w = {k: v.clone().requires_grad_(True) for k, v in random_drafter_weights(raw).items()}
    opt = torch.optim.AdamW(list(w.values()), lr=3e-3, weight_decay=0.0)
    A, B, T = anchors, BLOCK, SEQ_LEN
    ks = torch.arange(1, B)
    weight = torch.exp(-(ks - 1).float() / GAMMA)  # [B - 1]
    step = 0
    while step < max_steps:
        step += 1
        idx = torch.randint(0, data.shape[0], (16,), generator=gen)
        x, tp = data[idx], taps[idx]  # [N, T], [N, T, n_taps, H]
        N = x.shape[0]
        anchor = torch.randint(PERIOD, T - B + 1, (N, A), generator=gen)  # [N, A]
        pos = (anchor[..., None] + torch.arange(B)).reshape(N, A * B)  # [N, A * B]
        ids = torch.full((N, A, B), MASK_ID)
        ids[..., 0] = x.gather(1, anchor)
        labels = x.gather(1, pos).reshape(N, A, B)[..., 1:]  # [N, A, B - 1]
        # visibility: context t < anchor; the block's own rows (all of them, or causally)
        ctx_ok = torch.arange(T)[None, None, :] < anchor.repeat_interleave(B, 1)[..., None]
        same = torch.arange(A).repeat_interleave(B)
        blk_ok = same[:, None] == same[None, :]  # [A * B, A * B]
        c = context_features(w, cfg, tp)  # [N, T, H]
        h = F.embedding(ids.reshape(N, A * B), embed)
        ctx_pos = torch.arange(T)[None].expand(N, T)
        for i in range(cfg.num_hidden_layers):
            if cfg.layer_causal(i):
                j = torch.arange(A * B)
                mask_blk = blk_ok & (j[None, :] <= j[:, None])
            else:
                mask_blk = blk_ok
            mask = torch.cat([ctx_ok, mask_blk[None].expand(N, -1, -1)], dim=-1)
            ck, cv = context_kv(w, cfg, i, c, ctx_pos)
            h = layer_block(w, cfg, i, h, pos, ck, cv, mask)
        h = rms_norm(h, w["norm.weight"], cfg.rms_norm_eps).reshape(N, A, B, -1)[:, :, 1:]
        logits = F.linear(h, head)  # [N, A, B - 1, V]
        nll = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        loss = (nll.reshape(N, A, B - 1) * weight).sum() / (weight.sum() * N * A)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05 and bool((logits.argmax(-1) == labels).all()):
            break
    return {k: v.detach() for k, v in w.items()}, step


def save_drafter(path: Path, raw: dict, weights: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def make_proposer(drafter_dir: Path, target, num_drafts: int) -> DFlashProposer:
    """A DFlashProposer over `target`, with a drafter KV pool of 16 blocks."""
    config = SimpleNamespace(
        model=SimpleNamespace(dtype=torch.float32, device=torch.device("cpu")),
        cache=SimpleNamespace(block_size=KV_BLOCK, state_dtype=torch.float32),
    )
    spec = SimpleNamespace(model=str(drafter_dir), num_speculative_tokens=num_drafts, options={})
    proposer = DFlashProposer(spec, config)
    proposer.bind(target)
    proposer.allocate(CachePlan({"paged": 16}, {"paged": 1}), config)
    return proposer


def speculative_greedy(
    target, proposer: DFlashProposer, prompt: list[int], max_new: int
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt: (generated tokens, acceptance length per
    verify step = accepted drafts + the bonus token)."""
    runner = TargetRunner(target)
    seq = SimpleNamespace(
        seq_id=id(prompt),
        token_ids=list(prompt),
        block_ids=runner.block_ids,
        params=SimpleNamespace(temperature=0.0),
        generator=None,
    )
    taps = proposer.tap_layer_ids
    greedy, hidden = runner.forward(prompt, 0, taps)
    n = len(prompt)
    proposer.observe(TargetStep([ComputedRow(seq, 0, n, range(n))], hidden))
    seq.token_ids.append(int(greedy[-1]))
    lengths = []
    while len(seq.token_ids) - n < max_new:
        (draft,) = proposer.propose([seq], [BLOCK - 1])
        start = len(seq.token_ids) - 1
        row = [seq.token_ids[-1], *draft.token_ids]
        greedy, hidden = runner.forward(row, start, taps)
        a = 0
        while a < len(draft.token_ids) and draft.token_ids[a] == int(greedy[a]):
            a += 1
        proposer.observe(TargetStep([ComputedRow(seq, start, a + 1, range(a + 1))], hidden))
        seq.token_ids.extend(draft.token_ids[:a] + [int(greedy[a])])
        lengths.append(a + 1)
    proposer.release(seq)
    return seq.token_ids[n : n + max_new], lengths
