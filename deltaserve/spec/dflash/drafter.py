"""The DFlash drafter on the device: its weights, its paged context KV, context insertion and the
block forward for a batch of sequences.

The drafter is a second model beside the target (engine/model_instance.py): its layers declare
`AttentionSpec`s (pool "paged"), so the cache planner sizes its K / V with the target's
(`layer_specs()` added to the target's specs) and it can share the target's block tables: the
context K / V of position p of a sequence live in the same block slot as the target's K / V of
p, in the drafter's own tensors. Only context positions (accepted tokens whose target hidden
states are known) are ever written; the drafted block's K / V are not cached, so rejected
drafts leave nothing to roll back.

One drafting step for a row whose context covers positions 0 .. n - 1:

    drafter.insert_context(taps, positions, slot_mapping)   # the newly accepted positions
    tokens, probs = drafter.propose(last_tokens, ctx_lens, block_tables, num_drafts)

`last_tokens` is the row's last accepted token (the bonus token of the last verify step, whose
target hidden state is not known yet), at position n = ctx_len; the block is [last, MASK x k] at
positions n .. n + k; draft i is read at block position i + 1 (z-lab's `dflash_generate`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from deltaserve.cache.planner import CachePlan, allocate_caches
from deltaserve.cache.spec import AttentionSpec
from deltaserve.config import EngineConfig
from deltaserve.distributed.parallel_state import tp_size
from deltaserve.forward_context import Kernels, LayerCache
from deltaserve.loader.weights import build_model, load_weights
from deltaserve.models.dflash import DFlashDraftModel, DraftContext
from deltaserve.ops.attention.kv_writer import write_kv
from deltaserve.spec.dflash.attention import paged_block_attention
from deltaserve.spec.dflash.config import DFlashConfig, load_dflash_config


def gather_taps(hidden_states: dict[int, torch.Tensor], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The target forward's `ctx.hidden_states` (layer index -> [T, H]) -> taps [T, n_taps, H]
    in `target_layer_ids` order. A missing layer raises KeyError naming it."""
    missing = [i for i in layer_ids if i not in hidden_states]
    if missing:
        raise KeyError(f"the target forward did not keep the output of layer(s) {missing}")
    return torch.stack([hidden_states[i] for i in layer_ids], dim=1)


class DFlashDrafter:
    """A loaded drafter bound to its target's embedding and lm_head.

    Args:
        model: the drafter's layers (weights loaded or randomised).
        embed: token ids [N] -> the target's embeddings [N, H].
        compute_logits: hidden [N, H] -> the target lm_head's float32 logits [N, vocab].
        kernels: the fused ops to use (the target's choice on GPU); torch reference by default.
    """

    def __init__(
        self,
        model: DFlashDraftModel,
        embed: Callable[[torch.Tensor], torch.Tensor],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        kernels: Kernels | None = None,
    ) -> None:
        self.model = model
        self.config: DFlashConfig = model.config
        self.embed = embed
        self.compute_logits = compute_logits
        self.kernels = kernels or Kernels()
        self.caches: list[LayerCache] = []

    # ---- caches ----------------------------------------------------------------------------
    def layer_specs(self) -> list[AttentionSpec]:
        """One paged K / V spec per draft layer (context positions only)."""
        return self.model.layer_specs()

    def allocate(self, plan: CachePlan, config: EngineConfig) -> None:
        """The drafter's cache tensors for `plan` (planned over target + drafter specs)."""
        self.caches = allocate_caches(self.layer_specs(), plan, config)

    # ---- context ---------------------------------------------------------------------------
    @torch.inference_mode()
    def insert_context(
        self, taps: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write the context K / V of newly accepted positions into every draft layer's cache.

        Args:
            taps: [N, n_taps, H] the tapped target layers' outputs at those positions
                (`gather_taps`), rows of any number of sequences.
            positions: [N] their absolute positions (for the rotary).
            slot_mapping: [N] their paged-cache slots (block * block_size + offset; -1 skips).
        """
        N = taps.shape[0]
        if N == 0:
            return
        if taps.shape[1:] != (self.config.num_taps, self.config.hidden_size):
            cfg = self.config
            raise ValueError(
                f"taps are {tuple(taps.shape)}, expected [N, {cfg.num_taps}, "
                f"{cfg.hidden_size}] (target_layer_ids {list(cfg.target_layer_ids)})"
            )
        flat = taps.reshape(N, -1).to(self.model.fc.weight.dtype)  # [N, n_taps * H]
        for cache, (k, v) in zip(self.caches, self.model.context_kv(flat, positions, self.kernels)):
            write_kv(k, v, cache["k_cache"], cache["v_cache"], slot_mapping)

    # ---- block forward ---------------------------------------------------------------------
    def _check_drafts(self, num_drafts: int) -> None:
        if not 1 <= num_drafts <= self.config.block_size - 1:
            raise ValueError(
                f"num_drafts {num_drafts} is outside [1, block_size - 1 = "
                f"{self.config.block_size - 1}] for this drafter"
            )

    def block_hidden(
        self,
        last_tokens: torch.Tensor,
        ctx_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_len: int,
    ) -> torch.Tensor:
        """The block forward of R rows: [R, block_len, H] final-normed hidden states.

        Args:
            last_tokens: [R] each row's last accepted token (block position 0).
            ctx_lens: [R] int the context positions cached per row (the block starts there).
            block_tables: [R, nb] int the rows' paged-cache blocks (covering ctx_len).
            block_len: L = 1 + the number of drafts.
        Device tensors only, fixed shapes: CUDA-graph safe.
        """
        R, L = last_tokens.shape[0], block_len
        cfg = self.config
        ids = torch.full((R, L), cfg.mask_token_id, dtype=torch.long, device=last_tokens.device)
        ids[:, 0] = last_tokens
        offsets = torch.arange(L, device=ctx_lens.device)
        positions = (ctx_lens.long()[:, None] + offsets[None, :]).reshape(-1)  # [R * L]
        embeds = self.embed(ids.reshape(-1))  # [R * L, H]
        if cfg.input_embedding_scale != 1.0:
            embeds = embeds * cfg.input_embedding_scale
        caches = self.caches

        def attend(i, q, k, v, causal, window, scale):
            c = caches[i]
            return paged_block_attention(
                q, k, v, c["k_cache"], c["v_cache"], block_tables, ctx_lens, scale, causal, window
            )

        ctx = DraftContext(attend=attend, kernels=self.kernels)
        hidden = self.model(embeds.to(self.model.fc.weight.dtype), positions, ctx)
        return hidden.reshape(R, L, -1)

    def draft_logits(
        self,
        last_tokens: torch.Tensor,
        ctx_lens: torch.Tensor,
        block_tables: torch.Tensor,
        num_drafts: int,
    ) -> torch.Tensor:
        """[R, num_drafts, vocab] float32 logits of drafts 0 .. k - 1 (block positions 1 .. k)."""
        self._check_drafts(num_drafts)
        hidden = self.block_hidden(last_tokens, ctx_lens, block_tables, num_drafts + 1)
        R, H = hidden.shape[0], hidden.shape[-1]
        drafts = hidden[:, 1:].reshape(R * num_drafts, H)  # block positions 1 .. k
        logits = self.model.scale_logits(self.compute_logits(drafts))
        return logits.reshape(R, num_drafts, -1)

    @torch.inference_mode()
    def propose(
        self,
        last_tokens: torch.Tensor,
        ctx_lens: torch.Tensor,
        block_tables: torch.Tensor,
        num_drafts: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft `num_drafts` tokens per row: (tokens [R, k] int64, probs [R, k, vocab] or None).

        Greedy (temperature 0): the argmax of each draft's logits, no probabilities. Otherwise
        each draft is sampled from softmax(logits / temperature) and those probabilities are
        returned (what rejection sampling divides by)."""
        logits = self.draft_logits(last_tokens, ctx_lens, block_tables, num_drafts)
        if temperature <= 0.0:
            return logits.argmax(dim=-1), None
        probs = torch.softmax(logits / temperature, dim=-1)  # [R, k, V]
        flat = probs.reshape(-1, probs.shape[-1])
        tokens = torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
        return tokens, probs


def load_drafter(
    path: str | Path,
    target,
    dtype: torch.dtype,
    device: torch.device | str,
    kernels: Kernels | None = None,
    random_seed: int | None = None,
) -> DFlashDrafter:
    """Read a z-lab DFlash checkpoint directory (config.json + safetensors), check it against
    `target` (a loaded CausalLM: hidden size, vocabulary, layer count, tapped layers) and bind
    it to the target's embedding and lm_head. With `random_seed`, the weights are random (no
    safetensors needed: benchmarks). Raises DFlashConfigError / WeightLoadError naming the
    problem."""
    if tp_size() > 1:
        raise ValueError("a DFlash drafter under tensor parallelism is not supported yet")
    config = load_dflash_config(path)
    return build_drafter(config, target, dtype, device, kernels, path, random_seed)


def build_drafter(
    config: DFlashConfig,
    target,
    dtype: torch.dtype,
    device: torch.device | str,
    kernels: Kernels | None = None,
    path: str | Path | None = None,
    random_seed: int | None = None,
) -> DFlashDrafter:
    """A drafter of `config` for `target`, loaded from `path` or random (`random_seed`)."""
    tc = target.config
    config.check_target(
        int(tc.hidden_size), int(target.vocab_size), len(target.model.layers), "the drafter"
    )
    model = build_model(DFlashDraftModel, config, False, dtype, device)
    if random_seed is not None:
        from deltaserve.loader.random_model import init_random_weights

        init_random_weights(model, random_seed)
    elif path is None:
        raise ValueError("build_drafter needs a checkpoint path or a random seed")
    else:
        load_weights(model, path)
    return DFlashDrafter(model, target.model.embed_tokens, target.compute_logits, kernels)
