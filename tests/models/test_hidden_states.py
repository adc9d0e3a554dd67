"""Hidden states of requested decoder layers (`ForwardContext.hidden_layers`) against HF
transformers' own `output_hidden_states`, on tiny random checkpoints (float32, CPU).

Layer i's output is HF's `hidden_states[i + 1]`, except for the last layer: HF returns the
final-normed state there, so the last layer's raw output is taken from a forward hook on HF's
last decoder layer (and the normed one is compared with our forward's return value).
"""

from __future__ import annotations

import pytest
import torch
from hf_models import build_model

from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels
from deltaserve.loader.hf_config import load_hf_config
from deltaserve.loader.weights import build_model as build_ours
from deltaserve.loader.weights import load_weights
from deltaserve.models.base import AttentionSpec
from deltaserve.models.registry import get_model_class
from deltaserve.ops.attention.reference import TorchAttentionBackend
from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.gdn.reference import TorchConv1d, TorchGDNDecode, TorchGDNPrefill

BLOCK = 16
ATOL = RTOL = 1e-4


class Runner:
    """Our model on one sequence: prefill, then decode steps, over reference kernels."""

    def __init__(self, model) -> None:
        self.model = model
        self.caches = []
        for s in model.layer_specs():
            if isinstance(s, AttentionSpec):
                shape = (8, BLOCK, s.num_kv_heads, s.head_dim)
                self.caches.append(dict(k_cache=torch.zeros(shape), v_cache=torch.zeros(shape)))
            else:
                self.caches.append(
                    dict(
                        ssm_state=torch.zeros(2, s.num_v_heads, s.head_v_dim, s.head_k_dim),
                        conv_state=torch.zeros(2, s.conv_dim, s.conv_kernel - 1),
                    )
                )
        self.kernels = Kernels(
            attention=TorchAttentionBackend(),
            gdn=GDNKernels(TorchConv1d(), TorchGDNPrefill(), TorchGDNDecode()),
        )
        self.table = list(range(1, 8))
        self.num_cached = 0

    def step(self, ids: list[int], hidden_layers: tuple[int, ...]):
        """(final hidden states [T, hidden], ctx.hidden_states) of the next `ids`."""
        start, end = self.num_cached, self.num_cached + len(ids)
        pos = list(range(start, end))
        meta = BatchMetadata(
            slot_mapping=torch.tensor([self.table[p // BLOCK] * BLOCK + p % BLOCK for p in pos]),
            query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            context_lens=torch.tensor([start], dtype=torch.int32),
            block_tables=torch.tensor([self.table], dtype=torch.int32),
            state_slots=torch.tensor([1]),
            has_initial_state=torch.tensor([start > 0]),
            query_start_loc_cpu=[0, len(ids)],
            seq_lens_cpu=[end],
            context_lens_cpu=[start],
            state_slots_cpu=[1],
            num_decodes=1 if start > 0 else 0,
        )
        ctx = ForwardContext(
            meta=meta, caches=self.caches, kernels=self.kernels, hidden_layers=hidden_layers
        )
        with torch.inference_mode():
            out = self.model(torch.tensor(ids), torch.tensor(pos), ctx)
        self.num_cached = end
        return out, ctx.hidden_states


def _ours(model_dir):
    hf, text, arch = load_hf_config(model_dir)
    tie = bool(getattr(hf, "tie_word_embeddings", False))
    model = build_ours(get_model_class(arch), text, tie, torch.float32, "cpu")
    load_weights(model, model_dir)
    return model


@torch.no_grad()
def _hf_hidden(oracle, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(output of every decoder layer [L, T, hidden], the final-normed state [T, hidden])."""
    layers = oracle.model.layers
    last = {}
    hook = layers[-1].register_forward_hook(lambda m, a, out: last.setdefault("h", out))
    try:
        out = oracle(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    hs = [h[0] for h in out.hidden_states]  # embeddings, layer 0 .. layer L-2, normed final
    assert len(hs) == len(layers) + 1
    raw_last = last["h"][0] if isinstance(last["h"], tuple) else last["h"]
    return hs[1:-1] + [raw_last[0]], hs[-1]


@pytest.mark.parametrize("spec_name", ["qwen3_g5", "qwen3_5_r2_g3"])
def test_hidden_states_match_hf(tmp_path, spec_name):
    model_dir, oracle = build_model(spec_name, tmp_path / spec_name)
    model = _ours(model_dir)
    num_layers = len(model.model.layers)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, model.vocab_size - 4, (13,), generator=gen).tolist()
    ref_layers, ref_final = _hf_hidden(oracle, prompt + [7])

    # prefill: every layer asked for
    runner = Runner(model)
    final, hidden = runner.step(prompt, tuple(range(num_layers)))
    assert sorted(hidden) == list(range(num_layers))
    for i in range(num_layers):
        torch.testing.assert_close(
            hidden[i],
            ref_layers[i][:13],
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m, i=i: f"layer {i}: {m}",
        )
    torch.testing.assert_close(final, ref_final[:13], atol=ATOL, rtol=RTOL)

    # decode: only the layers asked for, on the decode row
    wanted = (0, num_layers - 1)
    final, hidden = runner.step([7], wanted)
    assert sorted(hidden) == sorted(wanted)
    for i in wanted:
        torch.testing.assert_close(hidden[i], ref_layers[i][13:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(final, ref_final[13:], atol=ATOL, rtol=RTOL)


def test_no_hidden_states_unless_asked(tmp_path):
    model_dir, _ = build_model("qwen3_5_r1_g1_tied", tmp_path / "m", load_oracle=False)
    model = _ours(model_dir)
    prompt = list(range(5, 25))
    plain, hidden = Runner(model).step(prompt, ())
    assert hidden == {}
    asked, hidden = Runner(model).step(prompt, (1, 2))
    assert sorted(hidden) == [1, 2]
    assert torch.equal(plain, asked)  # materialising a layer's output changes nothing else
