"""Tensor parallelism with decode graphs and overlapped decode, on CPU over gloo.

CUDA graphs cannot be captured on CPU; DELTASERVE_EMULATE_CUDA_GRAPHS=1 runs the graph path
without capture: the same buckets, static buffers and padding rows, the forward run eagerly at
each replay. Under TP=2 rank 0 names the bucket of every graph step and the worker checks it
picks the same one (a mismatch fails the worker, hence the run). The graph capture itself is
checked on GPUs (test_tensor_parallel_gpu.py).
"""

from __future__ import annotations

import gc

import pytest
import torch
from hf_models import SPECS_BY_NAME, build_model
from test_tensor_parallel import _make_llm

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.parallel_state import tp_size
from deltaserve.engine.model_runner import ModelRunner

PROMPT_LENS = (37, 5, 130)  # 3 rows: the bucket of 4 pads one row
NEW_TOKENS = 10


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    "spec_name, async_scheduling",
    [("qwen3_5_r2_g3", True), ("qwen3_g5", False)],
)
def test_tp2_graphs_and_overlap_match_tp1(
    tmp_path, monkeypatch, spec_name: str, async_scheduling: bool
) -> None:
    spec = SPECS_BY_NAME[spec_name]
    model_dir, _ = build_model(spec, tmp_path / spec_name, load_oracle=False)
    gen = torch.Generator().manual_seed(11)
    vocab = spec.config["vocab_size"]
    prompts = [torch.randint(3, vocab - 4, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    ref_llm = _make_llm(model_dir, 1, async_scheduling=False)  # eager, synchronous
    assert ref_llm.llm_engine.runner.graphs is None
    ref = _generate(ref_llm, prompts)
    del ref_llm

    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")  # inherited by the worker
    overlapped = []
    launch = ModelRunner.execute_async

    def counting_launch(self, *args, **kwargs):
        overlapped.append(1)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute_async", counting_launch)  # rank 0 only
    llm = _make_llm(model_dir, 2, async_scheduling=async_scheduling)
    procs = list(llm.llm_engine._tp_workers.processes)
    try:
        assert tp_size() == 2
        graphs = llm.llm_engine.runner.graphs
        assert graphs is not None and graphs.emulate and graphs.buckets == [1, 2, 4, 8]
        ours = _generate(llm, prompts)
        replays = dict(graphs.replays)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    assert [p.exitcode for p in procs] == [0]
    assert ours == ref
    # the decode steps ran in graphs, the padded bucket of 4 (3 rows) among them, overlapped
    # when asked
    assert sum(replays.values()) >= NEW_TOKENS - 1 and replays.get((4, 1), 0) >= 1, replays
    assert (len(overlapped) >= NEW_TOKENS - 2) == async_scheduling, len(overlapped)


def test_worker_refuses_a_bucket_it_would_not_pick() -> None:
    """A worker replays rank 0's bucket only if it picks the same one for the same rows."""
    from types import SimpleNamespace

    from deltaserve.distributed.worker_step import run_worker_step
    from deltaserve.engine.cuda_graph import batch_size_buckets
    from deltaserve.engine.step_prep import StepInput

    buckets = batch_size_buckets(8)  # [1, 2, 4, 8]: 3 rows replay bucket 4
    replayed = []
    instance = SimpleNamespace(
        graph_bucket=lambda n, q=1: next(b for b in buckets if b >= n),
        replay=lambda *args: replayed.append(args),
    )
    meta = SimpleNamespace(num_seqs=3, decode_query_len=1)
    runner = SimpleNamespace(
        apply_cache_ops=lambda ops: None,
        _peer_sampled_ids=None,
        stager=SimpleNamespace(tensors=lambda step, prev: (None, None, meta)),
        instance=instance,
        device=torch.device("cpu"),
    )

    def step(bucket: int) -> StepInput:
        lists = ([1, 2, 3], [5, 5, 5], torch.zeros(3), [0, 1, 2, 3], [6] * 3, [5] * 3, [1, 2, 3])
        return StepInput(*lists, torch.zeros(3, 1), num_decodes=3, graph_bucket=bucket)

    run_worker_step(runner, step(4))
    assert len(replayed) == 1
    with pytest.raises(RuntimeError, match="out of lockstep: rank 0 replays the decode graph of"):
        run_worker_step(runner, step(8))
    assert len(replayed) == 1
