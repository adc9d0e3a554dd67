"""Pre-norm decoder blocks: the residual block of one layer and the stack of layers.

The stack keeps a residual stream: layer i returns `(x, residual)` whose sum is its output
hidden state, and the add is fused into the next RMSNorm (`rms_norm(x, residual=r)` adds,
normalises and updates `r` in place), so a layer is a handful of launches around its matmuls.

Under tensor parallelism every mixer and feed-forward block ends in a sum over ranks. The stack
leaves each sum to the norm that follows it where the block allows (`leave_sums_to_norms`):
that norm then all-reduces, adds and normalises in one kernel where the fused path is installed
(parallel_state.all_reduce_rms_norm), which saves a launch and a barrier per block in decode.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.distributed.parallel_state import all_reduce, all_reduce_rms_norm, tp_size
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.norms import RMSNorm
from deltaserve.layers.parallel_linear import VocabParallelEmbedding, leave_output_partial
from deltaserve.ops.linear import NormedInput


class DecoderLayer(nn.Module):
    """`x = x + mixer(norm(x)); x = x + ffn(norm(x))`, in the residual-stream form.

    The mixer (attention, GDN, ...) is registered under `mixer_name`, its checkpoint name
    (`self_attn`, `linear_attn`), and called as `mixer(positions, h, ctx)`; the feed-forward
    block is registered as `mlp` and called as `ffn(h, ctx)`. A mixer that caches something
    exposes its `cache_spec`.
    """

    def __init__(
        self,
        mixer_name: str,
        mixer: nn.Module,
        ffn: nn.Module,
        hidden_size: int,
        rms_norm_eps: float,
        zero_centered_norm: bool = False,
    ) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = ffn
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps, zero_centered_norm)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps, zero_centered_norm)
        # whether the mixer / the ffn return this rank's partial sum (leave_sums_to_norms)
        self.mixer_partial = False
        self.ffn_partial = False

    def leave_sums_to_norms(self) -> None:
        """Under tensor parallelism: let the mixer and the ffn return partial sums where they
        can, the norm after each then all-reduces (a no-op at one rank)."""
        if tp_size() > 1:
            self.mixer_partial = leave_output_partial(self.mixer)
            self.ffn_partial = leave_output_partial(self.mlp)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        x_partial: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (the previous layer's output, this rank's partial sum of it when
        `x_partial`, or the embeddings when `residual` is None) -> (the FFN output, partial when
        `ffn_partial`; the stream it must be added to); their sum is this layer's output."""
        h, residual = self.mixer_input(x, residual, ctx, x_partial)
        h = self.mixer(positions, h, ctx)
        return self.ffn_output(h, residual, ctx)

    def mixer_input(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        x_partial: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input (as `forward` takes it) -> (the mixer's input, the stream)."""
        n1 = self.input_layernorm
        rms_norm = ctx.kernels.fused.rms_norm
        if residual is None:  # first layer: the stream starts as the embeddings
            return rms_norm(x, n1.weight, n1.eps, n1.zero_centered), x
        if (fused := normed_input(self.mixer, x, residual, n1, x_partial)) is not None:
            return fused
        return add_norm(x, residual, n1, rms_norm, x_partial)

    def ffn_output(
        self, h: torch.Tensor, residual: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixer's output and the stream -> `forward`'s result (FFN output, stream)."""
        n2 = self.post_attention_layernorm
        if (fused := normed_input(self.mlp, h, residual, n2, self.mixer_partial)) is not None:
            return self.mlp(fused[0], ctx), fused[1]
        h, residual = add_norm(h, residual, n2, ctx.kernels.fused.rms_norm, self.mixer_partial)
        return self.mlp(h, ctx), residual


def normed_input(
    block: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, partial: bool = False
) -> tuple[NormedInput, torch.Tensor] | None:
    """(the block's input as a `NormedInput`, the new stream) where the block's first
    projection can run the residual add and the norm itself (a block names that projection in
    `normed_input_projection`, and sets `rereads_input` if it reads its input again: the
    projection then also writes the normalised row; its decode GEMM says at how many rows the
    fusion pays: ops.linear `fuses_add_norm`), else None (run `add_norm`; always where x is
    this rank's partial sum, which must be all-reduced first)."""
    if partial:
        return None
    name = getattr(block, "normed_input_projection", None)
    proj = getattr(block, name, None) if name else None
    gemm = getattr(proj, "decode_gemm", None)
    if gemm is None or x.dim() != 2 or not gemm.fuses_add_norm(x.shape[0], x.shape[1]):
        return None
    stream = torch.empty_like(residual)
    normed = torch.empty_like(x) if getattr(block, "rereads_input", False) else None
    fused = NormedInput(x, residual, norm.weight, norm.eps, norm.zero_centered, stream, normed)
    return fused, stream


def add_norm(
    x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, rms_norm, partial: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), residual updated in place); x summed over ranks first when it is
    this rank's partial sum (`rms_norm`: the FusedOps one)."""
    if partial:
        return all_reduce_rms_norm(x, residual, norm.weight, norm.eps, norm.zero_centered, rms_norm)
    return rms_norm(x, norm.weight, norm.eps, norm.zero_centered, residual=residual)


class DecoderStack(nn.Module):
    """Embedding, decoder layers, final norm (the `model.*` part of the checkpoint)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        layers: list[nn.Module],
        rms_norm_eps: float,
        zero_centered_norm: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, rms_norm_eps, zero_centered_norm)

    @property
    def vocab_size(self) -> int:
        """The global vocabulary (every rank's, under tensor parallelism)."""
        return self.embed_tokens.num_embeddings

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final normed hidden states [T, hidden]. For each index i
        in `ctx.hidden_layers`, the output of layer i goes to `ctx.hidden_states[i]`."""
        x = self.embed_tokens(input_ids)
        if ctx.mm_embeds is not None:  # image placeholders take the vision tower's embeddings
            rows, embeds = ctx.mm_embeds
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        residual = None
        partial = False  # x is this rank's partial sum (leave_sums_to_norms)
        wanted = ctx.hidden_layers
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, ctx, partial)
            partial = layer.ffn_partial
            if wanted and i in wanted:
                # NOTE: the stream is summed lazily by the next norm (which updates `residual`
                # in place), so the output of layer i is materialised here, only when asked
                if partial:
                    x, partial = all_reduce(x), False
                ctx.hidden_states[i] = x + residual
        x, _ = add_norm(x, residual, self.norm, ctx.kernels.fused.rms_norm, partial)
        return x

    def leave_sums_to_norms(self) -> None:
        """Under tensor parallelism, each layer's blocks leave their sums over ranks to the
        norms after them where they can (DecoderLayer.leave_sums_to_norms)."""
        for layer in self.layers:
            layer.leave_sums_to_norms()
