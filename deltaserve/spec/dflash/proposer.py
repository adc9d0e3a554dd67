"""DFlashProposer: the DFlash drafter behind the engine's `Proposer` interface
(deltaserve/spec/proposer.py).

Life of a sequence, as the engine drives it:

- `observe(step)` after every target forward: the kept rows' tapped hidden states
  (`step.taps[layer]`, layers `tap_layer_ids` = the drafter's `target_layer_ids`) become
  context K / V at their positions, written into the drafter's paged cache;
- `propose(seqs, max_drafts)`: one block forward per distinct k for the rows about to decode;
  row i drafts `min(max_drafts[i], block_size - 1)` tokens after its last token;
- `release(seq)`: nothing to free (see below).

KV placement: the drafter's cache tensors have as many blocks as the target's paged pool (the
runner plans target + `layer_specs()` together and calls `allocate(plan, config)`; when the
target's caches are already allocated at `bind`, the drafter gets that many blocks outside the
budget, logged), and the
context K / V of position p of a sequence lives in the target's block for p
(`seq.block_ids`). The target holds a block for every computed position, and the drafter's
context never runs past the accepted positions, so the drafter needs no allocator of its own:
rejected drafts, rollbacks and preemption (blocks freed by the target; recomputed positions
are observed and written again) leave nothing behind.

Sampling: a greedy request (temperature < 1e-5) gets the argmax drafts (q one-hot, no probs);
a sampled one gets drafts sampled from softmax(draft_logits / temperature), returned as
`Draft.probs` for rejection sampling (any q keeps the target's distribution; top-p / top-k
are not applied to q). Draws use the request's generator, else one seeded by the
`draft_seed` option (default 0).
"""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.cache.planner import CachePlan
from deltaserve.cache.spec import AttentionSpec
from deltaserve.config import EngineConfig
from deltaserve.engine.sequence import Sequence
from deltaserve.forward_context import Kernels
from deltaserve.logger import get_logger
from deltaserve.spec.dflash.config import DFlashConfigError, load_dflash_config, parse_dflash_config
from deltaserve.spec.dflash.drafter import DFlashDrafter, build_drafter, gather_taps
from deltaserve.spec.dflash.graphs import DrafterGraphs
from deltaserve.spec.dflash.presets import drafter_preset_config, random_preset_name
from deltaserve.spec.draft_kv import allocate_beside_target
from deltaserve.spec.proposer import Draft, Proposer, TargetStep

logger = get_logger(__name__)

GREEDY_TEMPERATURE = 1e-5  # below this a request is greedy (SamplingParams)


class DFlashProposer(Proposer):
    """Drafts with a z-lab DFlash checkpoint (`speculative_config["model"]`: a directory, or
    `random:<preset>` for random weights of a released shape, deltaserve/spec/dflash/presets.py)."""

    def __init__(self, spec: Any, config: EngineConfig) -> None:
        super().__init__(spec, config)
        preset = random_preset_name(spec.model)
        if preset is not None:
            self.drafter_config = parse_dflash_config(drafter_preset_config(preset), spec.model)
        else:
            self.drafter_config = load_dflash_config(spec.model)
        cfg = self.drafter_config
        if spec.num_speculative_tokens > cfg.block_size - 1:
            raise DFlashConfigError(
                f"num_speculative_tokens {spec.num_speculative_tokens} is more than this "
                f"drafter drafts per block (block_size {cfg.block_size} - 1)"
            )
        self.tap_layer_ids = cfg.target_layer_ids
        self.random = preset is not None
        self.seed = int(spec.options.get("draft_seed", 0))
        self.generator: torch.Generator | None = None
        self.drafter: DFlashDrafter | None = None
        self.graphs: DrafterGraphs | None = None
        self.ctx_lens: dict[int, int] = {}  # seq_id -> context positions written

    # ---- set-up ----------------------------------------------------------------------------
    def bind(self, target: Any) -> None:
        """Load the drafter onto the target's device and dtype, bound to its embedding and
        lm_head (`target`: a ModelInstance, or a CausalLM in tests)."""
        model = target if isinstance(target, torch.nn.Module) else target.model
        kernels = getattr(target, "kernels", None)
        mc = self.config.model
        self.drafter = build_drafter(
            self.drafter_config,
            model,
            mc.dtype,
            mc.device,
            Kernels(fused=kernels.fused) if kernels is not None else None,
            path=None if self.random else self.spec.model,
            random_seed=self.seed if self.random else None,
        )
        self.generator = torch.Generator(device=mc.device).manual_seed(self.seed)
        allocate_beside_target(self, target, self.config, "DFlash drafter")

    def layer_specs(self) -> list[AttentionSpec]:
        """The drafter's cache specs (pool "paged"), to plan with the target's (known from
        the config alone: callable before `bind`)."""
        cfg = self.drafter_config
        spec = AttentionSpec(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        return [spec] * cfg.num_hidden_layers

    def allocate(self, plan: CachePlan, config: EngineConfig) -> None:
        """The drafter's K / V tensors: the plan's paged blocks (the target's block ids)."""
        self._bound().allocate(plan, config)

    def capture_graphs(self, max_batch: int, max_blocks: int, emulate: bool = False) -> None:
        """CUDA graphs of the greedy block forward for k = num_speculative_tokens, up to
        `max_batch` rows whose block tables are at most `max_blocks` wide (the target's
        cdiv(max_model_len, block_size)). All-greedy groups of that k that fit replay them;
        others (sampled rows, fewer drafts near max_tokens) run eagerly, as does context
        insertion. `emulate`: no capture, the replays run eagerly (CPU tests)."""
        k = self.spec.num_speculative_tokens
        self.graphs = DrafterGraphs(self._bound(), max_batch, k, max_blocks, emulate)
        self.graphs.capture()
        logger.info(
            "DFlash drafter: the greedy block forward (k = %d) runs in CUDA graphs for batch "
            "buckets %s%s; sampled drafts, rows drafting fewer than k and context insertion "
            "run eagerly",
            k,
            self.graphs.buckets,
            " (emulated)" if emulate else "",
        )

    def _bound(self) -> DFlashDrafter:
        if self.drafter is None:
            raise RuntimeError("DFlashProposer.bind(target) must run before drafting")
        return self.drafter

    # ---- the engine's calls ----------------------------------------------------------------
    def observe(self, step: TargetStep) -> None:
        """Write the context K / V of every kept row of a target step."""
        drafter = self._bound()
        if not step.rows:
            return
        if not drafter.caches:
            raise RuntimeError("DFlashProposer.allocate(plan, config) must run before drafting")
        taps = gather_taps(step.taps, self.tap_layer_ids)  # [T, n_taps, H]
        bs = self.config.cache.block_size
        rows, positions, slots = [], [], []
        for row in step.rows:
            if row.num_kept == 0:
                continue
            first = row.first_position
            pos = list(range(first, first + row.num_kept))
            blocks = row.seq.block_ids
            if (pos[-1] // bs) >= len(blocks):
                raise RuntimeError(
                    f"sequence {row.seq.seq_id}: position {pos[-1]} has no KV block "
                    f"({len(blocks)} blocks of {bs})"
                )
            rows.append(torch.as_tensor(list(row.hidden_rows), dtype=torch.long))
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            self.ctx_lens[row.seq.seq_id] = first + row.num_kept
        if not rows:
            return
        device = taps.device
        index = torch.cat(rows).to(device)
        drafter.insert_context(
            taps.index_select(0, index),
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(slots, dtype=torch.long, device=device),
        )

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        """Drafts for each of `seqs`, rows grouped by their number of drafts."""
        drafter = self._bound()
        cap = self.drafter_config.block_size - 1
        ks = [min(int(k), cap) for k in max_drafts]
        out: list[Draft] = [Draft() for _ in seqs]
        for k in sorted(set(ks)):
            if k < 1:
                continue
            idx = [i for i, ki in enumerate(ks) if ki == k]
            drafts = self._propose_group(drafter, [seqs[i] for i in idx], k)
            for i, draft in zip(idx, drafts):
                out[i] = draft
        return out

    def _propose_group(self, drafter: DFlashDrafter, seqs: list[Sequence], k: int) -> list[Draft]:
        """k drafts for each of `seqs` from one block forward."""
        device = self.config.model.device
        ctx_lens, last, tables = [], [], []
        for seq in seqs:
            n = self.ctx_lens.get(seq.seq_id, 0)
            if n != len(seq.token_ids) - 1:
                raise RuntimeError(
                    f"sequence {seq.seq_id}: the drafter holds context for {n} positions but the "
                    f"sequence has {len(seq.token_ids)} tokens (expected {len(seq.token_ids) - 1}"
                    "; was every target step observed?)"
                )
            ctx_lens.append(n)
            last.append(seq.token_ids[-1])
            tables.append(seq.block_ids)
        width = max(1, max(len(t) for t in tables))
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for r, t in enumerate(tables):
            table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        args = (
            torch.tensor(last, dtype=torch.long, device=device),
            torch.tensor(ctx_lens, dtype=torch.int32, device=device),
            table.to(device),
        )
        temps = [float(getattr(seq.params, "temperature", 0.0)) for seq in seqs]
        g = self.graphs
        if (
            g is not None
            and k == g.num_drafts
            and all(t < GREEDY_TEMPERATURE for t in temps)
            and g.bucket(len(seqs)) is not None
            and width <= g.max_blocks
        ):
            return [Draft(row) for row in g.replay(*args).tolist()]
        with torch.inference_mode():
            logits = drafter.draft_logits(*args, k)  # [R, k, V] float32
        drafts = []
        for r, (seq, temperature) in enumerate(zip(seqs, temps)):
            if temperature < GREEDY_TEMPERATURE:
                drafts.append(Draft(logits[r].argmax(-1).tolist()))
                continue
            probs = torch.softmax(logits[r] / temperature, dim=-1)  # [k, V]
            gen = seq.generator if seq.generator is not None else self.generator
            # a request's generator may live on the host while the logits are on the device
            src = probs if gen is None or gen.device == probs.device else probs.to(gen.device)
            tokens = torch.multinomial(src, 1, generator=gen)[:, 0]
            drafts.append(Draft(tokens.tolist(), probs))
        return drafts

    def assume_context(self, seq: Sequence) -> None:
        """Benchmarks with synthetic contexts (deltaserve/bench/spec.py): treat the computed
        positions of `seq` as observed; their context K / V is whatever the cache holds."""
        self.ctx_lens[seq.seq_id] = seq.num_computed_tokens

    def release(self, seq: Sequence) -> None:
        """Forget the sequence's context length (its KV blocks are the target's)."""
        self.ctx_lens.pop(seq.seq_id, None)
