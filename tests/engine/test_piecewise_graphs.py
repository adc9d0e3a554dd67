"""Eager steps run piecewise (engine/piecewise_graphs.py: the dense part from CUDA graphs per
bucket of token rows, the mixers' cores eagerly between them) compute what the plain eager
forward computes.

On CPU the graphs are emulated (DELTASERVE_EMULATE_CUDA_GRAPHS=1): each "replay" runs its piece
eagerly on the static buffers, so the buckets, padding rows and the buffer hand-offs between
pieces and cores are the ones a GPU replays. Tiny float32 models of the mixer kinds that have
pieces: gated attention + GDN (Qwen3.5), ungated attention (Qwen3), routed experts
(Qwen3.5-MoE) and MLA absorbed and expanded (DeepSeek-V2), batched, with chunked prefill, decode
rows beside prefill rows and prefix-cache hits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from test_invariants import random_prompt  # noqa: E402
from test_row_buckets import LOGPROB_TOL, MODELS, make_llm, run  # noqa: E402

from deltaserve import LLM  # noqa: E402
from deltaserve.engine.piecewise_graphs import (  # noqa: E402
    BUCKETS,
    PiecewiseGraphs,
    bucket_sizes,
    unsupported_reason,
)


def test_buckets() -> None:
    assert bucket_sizes(0) == ()
    assert bucket_sizes(100) == (16, 32, 64, 96)
    assert bucket_sizes(1 << 20) == BUCKETS
    assert list(BUCKETS) == sorted(set(BUCKETS)) and all(b % 16 == 0 for b in BUCKETS)


class CoreSpy:
    """Records (rows of the pre outputs a core got, the step's tokens) of layer 0's cores, of
    piecewise forwards and of eager ones (whose `forward` calls the pieces too)."""

    def __init__(self, llm: LLM) -> None:
        self.calls: list[tuple[int, int]] = []
        mixer = llm.llm_engine.runner.instance.model.model.layers[0].mixer
        real = mixer.core

        def core(parts, ctx):
            self.calls.append((parts[0].shape[0], ctx.token_rows(parts[0].shape[0])))
            return real(parts, ctx)

        mixer.core = core


@pytest.mark.parametrize(
    "name,env", MODELS, ids=[n + ("-expanded" if e else "") for n, e in MODELS]
)
def test_piecewise_equals_eager(name, env, tmp_path, monkeypatch) -> None:
    model_dir, _ = build_model(SPECS_BY_NAME[name], tmp_path / "m", load_oracle=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    vocab = 200  # below every tiny model's vocabulary
    # 17..77-token prompts, several at once, one split by chunked prefill (41-token chunks),
    # then a prompt that shares the first one's prefix (a prefix-cache hit)
    prompts = [random_prompt(n, vocab, seed) for seed, n in enumerate((17, 33, 77, 50))]
    prompts.append(prompts[2][:64] + random_prompt(9, vocab, 9))
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    outs = {}
    for tokens in ("0", "64"):
        monkeypatch.setenv("DELTASERVE_PIECEWISE_GRAPH_TOKENS", tokens)
        llm = make_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=41, block_size=8)
        spy = CoreSpy(llm)
        outs[tokens] = run(llm, prompts[:3]) + run(llm, prompts[3:])
        pw = llm.llm_engine.runner.instance.piecewise
        if tokens == "0":
            assert pw is None and all(rows == n for rows, n in spy.calls)  # no padding
        else:
            assert pw is not None and pw.emulate and pw.sizes == (16, 32, 64)
            # decode steps replay decode graphs (at most 4 rows, each a token); every other
            # step ran piecewise, in its bucket
            steps = [(rows, n) for rows, n in spy.calls if rows > 4]
            assert len(steps) == sum(pw.replays.values()) > 0
            assert all(rows == pw.bucket(n) for rows, n in steps), steps
            assert any(rows > n for rows, n in steps), steps  # padded buckets ran
        sched = llm.llm_engine.scheduler
        assert not sched.running and not sched.waiting
        for pool in sched.pools:
            assert pool.num_used == 0, pool
    for (want_ids, want_lps), (got_ids, got_lps) in zip(outs["0"], outs["64"], strict=True):
        assert got_ids == want_ids
        assert max(abs(a - b) for a, b in zip(want_lps, got_lps)) < LOGPROB_TOL


def test_in_step_snapshots_under_pieces_equal_eager(tmp_path, monkeypatch) -> None:
    """Prefix-cache snapshots taken inside prefill steps (every 16 tokens: the GDN cores store
    them) while the steps run piecewise: the same output as eager steps, then hits on them."""
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "m", load_oracle=False)
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    prompts = [random_prompt(n, 200, seed) for seed, n in enumerate((45, 61))]
    prompts.append(prompts[1][:40] + random_prompt(11, 200, 7))  # hits a snapshot at 32
    outs, checkpointed = {}, {}
    for tokens in ("0", "64"):
        monkeypatch.setenv("DELTASERVE_PIECEWISE_GRAPH_TOKENS", tokens)
        llm = make_llm(
            model_dir, max_num_batched_tokens=64, block_size=8, prefix_snapshot_interval=16
        )
        instance = llm.llm_engine.runner.instance
        real, seen = instance.forward, []

        def forward(ids, pos, meta, *args, real=real, seen=seen, **kw):
            seen.append(bool(meta.checkpoints))
            return real(ids, pos, meta, *args, **kw)

        instance.forward = forward
        outs[tokens] = run(llm, prompts[:2]) + run(llm, prompts[2:])
        checkpointed[tokens] = sum(seen)
        if tokens == "64":
            assert sum(instance.piecewise.replays.values()) == len(seen)  # every eager step
        assert llm.llm_engine.scheduler.prefix_cache.num_hit_tokens >= 32  # the third prompt
    assert checkpointed["64"] > 0 and checkpointed["64"] == checkpointed["0"]
    for (want_ids, want_lps), (got_ids, got_lps) in zip(outs["0"], outs["64"], strict=True):
        assert got_ids == want_ids
        assert max(abs(a - b) for a, b in zip(want_lps, got_lps)) < LOGPROB_TOL


def test_buckets_stop_at_the_step_token_budget(tmp_path, monkeypatch) -> None:
    """No bucket is captured past the one that holds the scheduler's step token budget."""
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_g4_kv2"], tmp_path / "m", load_oracle=False)
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    llm = make_llm(model_dir, max_num_batched_tokens=100)
    assert llm.llm_engine.runner.instance.piecewise.sizes == (16, 32, 64, 96, 128)


def test_steps_over_the_largest_bucket_run_eagerly(tmp_path, monkeypatch) -> None:
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "m", load_oracle=False)
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DELTASERVE_PIECEWISE_GRAPH_TOKENS", "32")
    llm = make_llm(model_dir, max_num_batched_tokens=64)
    spy = CoreSpy(llm)
    run(llm, [random_prompt(60, 100, 1)])  # one 60-token prefill step: eager
    pw = llm.llm_engine.runner.instance.piecewise
    assert pw is not None and pw.sizes == (16, 32)
    assert sum(pw.replays.values()) == 0  # the prefill step ran eagerly, then decode graphs
    assert spy.calls and spy.calls[0] == (60, 60)


def test_models_say_why_they_take_no_pieces(tmp_path, monkeypatch) -> None:
    """A routed-expert block runs in the pieces only where its moe backend captures (the
    torch reference reads the routing on the host); an emulated run captures nothing."""
    model_dir, _ = build_model(
        SPECS_BY_NAME["qwen3_5_moe_e10k3_g3"], tmp_path / "m", load_oracle=False
    )
    llm = make_llm(model_dir)
    instance = llm.llm_engine.runner.instance
    assert instance.piecewise is None  # no decode graphs on CPU, so no pieces either
    reason = unsupported_reason(instance.model, instance.kernels)
    assert reason is not None and "moe backend torch cannot be captured" in reason
    assert unsupported_reason(instance.model, instance.kernels, emulate=True) is None
    stub = torch.nn.Module()
    assert "no DecoderStack" in unsupported_reason(stub, instance.kernels)


def test_pieces_read_no_layout_or_cache(tmp_path, monkeypatch) -> None:
    """The graphed pieces run with no batch layout and no caches: a piece that read either
    would fail here (it would bake one step's layout into every replay)."""
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "m", load_oracle=False)
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    llm = make_llm(model_dir)
    instance = llm.llm_engine.runner.instance
    pw = PiecewiseGraphs(instance.model, instance.kernels, (16,), torch.device("cpu"))
    ctx = pw._piece_ctx()
    assert ctx.meta is None and ctx.caches == []
    for i in range(len(pw.layers) + 1):
        pw._piece(i, 16, ctx)
    assert torch.isfinite(pw.hidden).all()


def test_no_gc_holds_the_collector_off_during_captures() -> None:
    """Graph captures run with Python's cyclic collector paused (a collection mid-capture may
    destroy another engine's graphs or events, which invalidates the capture), and it is back
    on afterwards, also when a capture raises."""
    import gc

    from deltaserve.engine.cuda_graph import no_gc

    assert gc.isenabled()
    with no_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_gc():
        raise RuntimeError("a capture failed")
    assert gc.isenabled()
