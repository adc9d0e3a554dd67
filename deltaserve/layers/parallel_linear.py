"""Tensor-parallel layers: column- and row-parallel linears, vocab-parallel embedding and
lm_head. At tensor-parallel size 1 each is the plain layer (same parameters, same math, no
collective).

Every layer declares `tp_rules`: (parameter attribute, fused shard name or None) -> ShardRule,
how the loader cuts a checkpoint tensor into this rank's shard. Parameters hold only the shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.distributed.parallel_state import all_gather, all_reduce, tp_rank, tp_size
from deltaserve.distributed.sharding import ShardRule, cdiv, divide
from deltaserve.ops.linear import MAX_ROWS as DECODE_GEMM_MAX_ROWS
from deltaserve.ops.linear import NormedInput


class ColumnParallelLinear(nn.Linear):
    """Output features split across ranks; the output stays split (no collective).

    `shards` maps each checkpoint sub-module fused here (e.g. "q_proj", "k_proj", "v_proj") to
    its global output size, or to a tuple of consecutive pieces that are split separately (GDN's
    in_proj_qkv is [q | k | v]: each rank takes its heads of q, of k and of v). A rank's output is
    its part of every shard, in shard order; `split` cuts it back into shards (views).

    Shards named in `replicated` are whole on every rank (no rule: the loader copies the full
    tensor; e.g. a MoE router fused beside split shared-expert rows). A shard in `replicas`
    (name -> r) is split into tp // r parts, each held by r consecutive ranks (attention kv
    heads when there are fewer than ranks).
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int | tuple[int, ...]],
        bias: bool = False,
        replicated: tuple[str, ...] = (),
        replicas: dict[str, int] | None = None,
    ) -> None:
        tp = tp_size()
        rules: dict[tuple[str, str | None], ShardRule] = {}
        offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        unknown = set(replicated) - set(shards)
        if unknown:
            raise ValueError(f"replicated shards {sorted(unknown)} are not among {list(shards)}")
        for name, size in shards.items():
            if name in replicated:
                if not isinstance(size, int):
                    raise ValueError(f"replicated shard {name} must be one piece, got {size}")
                offsets[name] = (offset, size)
                offset += size
                continue
            pieces = (size,) if isinstance(size, int) else tuple(size)
            r = (replicas or {}).get(name, 1)
            for p in pieces:
                divide(p, tp // r, f"the output size of {name}")
            rule = ShardRule(0, pieces, replicas=r)
            rules[("weight", name)] = rule
            rules[("bias", name)] = rule
            local = rule.local_size(tp)
            offsets[name] = (offset, local)
            offset += local
        super().__init__(in_features, offset, bias=bias)
        self.tp_rules = rules
        self.shard_offsets = offsets
        self.decode_gemm = None  # ops.linear: set at start-up by the model runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, self.bias)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split the fused local output [.., sum] back into its shards (views)."""
        return list(torch.split(y, [s for _, s in self.shard_offsets.values()], dim=-1))


class RowParallelLinear(nn.Linear):
    """Input features split across ranks (the input is a column-parallel output); the partial
    products are summed over ranks, then the (replicated) bias is added.

    With `reduce_results=False` the output is this rank's partial product (no bias allowed):
    the caller sums it with other partials and all-reduces once (a MoE block's shared expert)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True
    ) -> None:
        tp = tp_size()
        if bias and not reduce_results:
            raise ValueError("a row-parallel linear that leaves its sum to the caller has no bias")
        super().__init__(
            divide(in_features, tp, "the input size of a row-parallel linear"), out_features, bias
        )
        self.reduce_results = reduce_results
        self.tp_rules = {("weight", None): ShardRule(1, (in_features,))}
        self.decode_gemm = None  # ops.linear: set at start-up by the model runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(self, x, None)
        if not self.reduce_results:
            return y
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias


def leave_output_partial(block: nn.Module) -> bool:
    """Make a mixer or feed-forward block return this rank's partial sum instead of the sum
    over ranks, its caller then all-reduces (fused into the next RMSNorm: see
    deltaserve.layers.decoder). A block opts in with the class attribute `partial_output`: the
    name of the RowParallelLinear that ends it, or "self" for a block that all-reduces its own
    result (it then honours its own `reduce_results`). Returns False, changing nothing, where
    the block has no such attribute or its last linear adds a bias after the sum."""
    name = getattr(block, "partial_output", None)
    if name == "self":
        block.reduce_results = False
        return True
    proj = getattr(block, name, None) if name else None
    if not isinstance(proj, RowParallelLinear) or proj.bias is not None:
        return False
    proj.reduce_results = False
    return True


def _linear(layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias): the layer's decode GEMM for decode-sized inputs (ops.linear: at most
    its `max_rows`, else MAX_ROWS), else F.linear. A `NormedInput` (a decoder layer's residual
    add and norm, left to this projection: layers/decoder.py) goes to the GEMM's `add_norm`."""
    gemm = layer.decode_gemm
    if isinstance(x, NormedInput):
        return gemm.add_norm(x, layer.weight, bias)
    if (
        gemm is not None
        and x.dim() == 2
        and x.shape[0] <= getattr(gemm, "max_rows", DECODE_GEMM_MAX_ROWS)
    ):
        return gemm(x, layer.weight, bias)
    return F.linear(x, layer.weight, bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (cdiv(vocab, tp) each, the tail padded): every rank
    looks up the ids it owns, zeroes the others, and the rows are summed over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp, rank = tp_size(), tp_rank()
        self.num_embeddings = vocab_size  # the global vocabulary (what callers mean by it)
        self.embedding_dim = hidden_size
        rule = ShardRule(0, (vocab_size,), pad=True)
        self.tp_rules = {("weight", None): rule}
        self.vocab_start, self.vocab_end = rule.local_range(rank, tp)
        self.weight = nn.Parameter(torch.empty(cdiv(vocab_size, tp), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(owned, input_ids - self.vocab_start, 0)
        x = F.embedding(local, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(x)


class ParallelLMHead(nn.Module):
    """The lm_head's vocabulary rows, split as `VocabParallelEmbedding` splits them."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        tp = tp_size()
        self.vocab_size = vocab_size
        self.tp_rules = {("weight", None): ShardRule(0, (vocab_size,), pad=True)}
        self.weight = nn.Parameter(torch.empty(cdiv(vocab_size, tp), hidden_size))


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """hidden [N, hidden] x this rank's vocabulary rows -> full float32 logits [N, vocab] on
    every rank (the shards are all-gathered, the padding cut off)."""
    logits = F.linear(hidden, weight).float()  # [N, vocab / tp (padded)]
    if tp_size() == 1:
        return logits
    return all_gather(logits, dim=-1)[:, :vocab_size]
