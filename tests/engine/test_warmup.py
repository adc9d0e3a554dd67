"""The start-up warm-up (deltaserve/engine/warmup.py), forced on for a tiny hybrid model (GDN +
attention) with prefix caching on CPU: it runs the steps it promises (one row at odd, even and
multiple-of-16 token counts, 16 rows, decode rows beside prefill rows, a split prompt, prefix
hits with in-step checkpoints) and then leaves the engine exactly as a fresh one: every pool's
and the prefix cache's bookkeeping, the counters and statistics, the sampler's generator. Greedy
tokens and float32 logprobs afterwards equal those of an engine built without it, the prefix
cache's counters too (a prompt of the warm-up, sent again, does not hit). Also with
speculative decoding and with overlapped decode. The flag and the default (off on CPU)."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from deltaserve import LLM, SamplingParams, cli
from deltaserve.config import create_engine_config
from deltaserve.engine import warmup
from deltaserve.engine.model_runner import ModelRunner
from deltaserve.engine.prefix_cache import PrefixCacheStats
from deltaserve.spec.proposer import Draft, Proposer
from deltaserve.spec.registry import ProposerMethod, register_proposer

BUDGET = 512  # max_num_batched_tokens: the long warm-up prompts are split into chunks
COMMON = dict(
    random_model="tiny-qwen3.5",
    device="cpu",
    dtype="float32",
    max_model_len=1280,
    max_num_seqs=20,
    max_num_batched_tokens=BUDGET,
    seed=0,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


class RepeatProposer(Proposer):
    """Drafts a sequence's last token again, k times: drafts every decode (unlike n-gram
    lookup over random tokens), mostly rejected, so verify rows and rollbacks run."""

    def propose(self, seqs, max_drafts):
        return [Draft([s.token_ids[-1]] * k) for s, k in zip(seqs, max_drafts, strict=True)]


register_proposer(ProposerMethod("warmup_test_repeat", RepeatProposer))


class Built:
    """An LLM and what its runner executed while it was built (one entry per synchronous
    step: rows as (request id, computed tokens, new tokens, is decode, drafts), checkpoints),
    the warm-up's prompts, the engine's counts just before the warm-up's reset and its state
    once built."""

    def __init__(self, **kwargs) -> None:
        self.steps: list[tuple[list[tuple], int]] = []
        self.before_reset: dict = {}
        self.prompts: list[list[int]] = []  # the warm-up's
        execute, reset, submit = ModelRunner.execute, warmup.reset_engine, warmup._Driver.submit

        def recording(runner, batch, banned):
            rows = [
                (r.seq.request_id, r.seq.num_computed_tokens, r.num_new, r.is_decode, r.num_draft)
                for r in batch.items
            ]
            self.steps.append((rows, len(batch.checkpoints)))
            return execute(runner, batch, banned)

        def resetting(engine) -> None:
            spec = engine.spec.stats.num_verify_rows if engine.spec is not None else 0
            self.before_reset = {**engine.prefix_cache_stats(), "verify_rows": spec}
            reset(engine)

        def submitting(driver, prompts, params):
            self.prompts += [p for p in prompts if p is not None]
            return submit(driver, prompts, params)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ModelRunner, "execute", recording)
            mp.setattr(warmup._Driver, "submit", submitting)
            mp.setattr(warmup, "reset_engine", resetting)
            self.llm = LLM(**{**COMMON, **kwargs})
        self.engine = self.llm.llm_engine
        self.state = copy.deepcopy(engine_state(self.engine))  # as built, before any request

    def prefills(self, decodes: int | None = 0) -> list[list[tuple]]:
        """The steps' prefill rows, of the steps with `decodes` decode rows (None: any)."""
        out = []
        for rows, _ in self.steps:
            nd = sum(1 for r in rows if r[3])
            if decodes is None or nd == decodes:
                out.append([r for r in rows if not r[3]])
        return out


@pytest.fixture(scope="module")
def warm() -> Built:
    return Built(warmup=True)


@pytest.fixture(scope="module")
def fresh() -> Built:
    return Built()  # the default on CPU: no warm-up


def plain(obj) -> dict:
    """An object's bookkeeping: its attributes that are plain values or containers."""
    kinds = (bool, int, float, str, list, tuple, dict, set, range, PrefixCacheStats)
    return {k: v for k, v in vars(obj).items() if isinstance(v, kinds)}


def engine_state(engine) -> dict:
    sched = engine.scheduler
    cache = sched.prefix_cache
    state = {
        "requests": dict(engine.requests),
        "queues": (len(sched.waiting), len(sched.running)),
        "scheduler": plain(sched),
        "pools": [(p.kind, plain(p)) for p in sched.pools],
        "cache": plain(cache) if cache is not None else None,
        "blocks": plain(cache.blocks) if cache is not None else None,
        "prefix_stats": engine.prefix_cache_stats(),
        "usage": engine.cache_usage(),
        "counters": dataclasses.asdict(engine.counters),
        "stats": plain(engine.stats) | {"timer": plain(engine.stats.timer)},
        "generator": engine.runner.sampler.default_generator.get_state().tolist(),
        "spec": plain(engine.spec.stats) if engine.spec is not None else None,
        "eager_forwards": engine.runner.instance.num_eager_forwards,
    }
    for objects in ("pools", "release_hooks"):  # compared above / the engine's own proposer
        state["scheduler"].pop(objects)
    state["stats"].pop("t0")  # the window's start time
    state["stats"]["timer"].pop("_last")
    return state


def test_the_default_builds_no_warm_up(fresh: Built) -> None:
    assert fresh.engine.config.warmup is None
    assert fresh.steps == []


def test_warm_up_runs_the_steps_it_promises(warm: Built) -> None:
    assert warm.steps, "nothing ran"
    rids = {r[0] for rows, _ in warm.steps for r in rows}
    assert all(rid.startswith(warmup.REQUEST_PREFIX) for rid in rids)
    alone = [rows[0][2] for rows in warm.prefills(0) if len(rows) == 1 and rows[0][1] == 0]
    assert {7, 11, 47, 48, 50, 250, 301} <= set(alone)  # <= 8, <= 16; odd, x16, even; 16 blocks
    widths = {len(rows) for rows in warm.prefills(0)}
    assert {3, 4, 16} <= widths
    # decode rows beside prefill rows: 3 and 16 decodes, and some with prefix hits
    assert any(warm.prefills(3)) and any(warm.prefills(16))
    assert any(r[2] == BUDGET for rows in warm.prefills(0) for r in rows)  # a split prompt
    assert any(len(rows) > 1 and sum(r[2] for r in rows) == BUDGET for rows in warm.prefills(0))
    assert any(r[1] > 0 for rows in warm.prefills(None) for r in rows)  # chunks, hits: context
    assert sum(ck for _, ck in warm.steps) > 0  # in-step snapshots
    hits = warm.before_reset
    assert hits["prefix_cache_hits"] >= 10 and hits["prefix_snapshots_taken"] > 0


def test_warm_up_leaves_the_engine_as_fresh(warm: Built, fresh: Built) -> None:
    state = warm.state
    assert state["counters"] == {"prompt_tokens_computed": 0} and state["stats"]["steps"] == 0
    assert state["requests"] == {} and state["usage"]["kv_blocks_used"] == 0
    assert (
        state["prefix_stats"]["prefix_snapshots_held"] == 0
        and state["blocks"]["hash_to_block"] == {}
    )
    assert warm.state == fresh.state


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    result = []
    for out in outs:
        c = out.outputs[0]
        result.append((c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


def prompts(warm: Built) -> list[list[int]]:
    """A few prompts, the warm-up's of 47 tokens among them (cached at 32 during the warm-up:
    a hit if the cache were not emptied), and the second turn of one of them (a hit once it
    ran)."""
    seen = next(p for p in warm.prompts if len(p) == 47)
    rng = random.Random(1)
    new = [[rng.randrange(16, 256) for _ in range(n)] for n in (37, 200, 5)]
    return [seen, *new, new[1] + new[2]]


def test_outputs_after_warm_up_equal_a_fresh_engine(warm: Built, fresh: Built) -> None:
    batch = prompts(warm)
    for _ in range(2):  # the second time, every prompt with a full block hits
        assert run(warm.llm, batch) == run(fresh.llm, batch)
        assert warm.engine.prefix_cache_stats() == fresh.engine.prefix_cache_stats()
    assert warm.engine.prefix_cache_stats()["prefix_cache_hits"] > 0


SPECULATIVE = {"method": "warmup_test_repeat", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(speculative_config=SPECULATIVE, runtime_stats=True),
        dict(speculative_config=SPECULATIVE, graphs=True),
        dict(async_scheduling=True, graphs=True),
    ],
    ids=["speculative", "speculative-graphs", "async-graphs"],
)
def test_warm_up_with_speculative_or_overlapped_decode(
    kwargs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kwargs.pop("graphs", False):  # decode-graph replays (emulated on CPU), counted
        monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    if kwargs.pop("runtime_stats", False):  # steps and their times, counted
        monkeypatch.setenv("DELTASERVE_RUNTIME_STATS", "1")
    warm, fresh = Built(warmup=True, **kwargs), Built(warmup=False, **kwargs)
    if "speculative_config" in kwargs:
        assert warm.before_reset["verify_rows"] > 0  # the warm-up verified drafts
        k = SPECULATIVE["num_speculative_tokens"]  # a full row of them beside prefill rows
        assert any(
            any(r[4] == k for r in rows) and not all(r[3] for r in rows) for rows, _ in warm.steps
        )
        assert warm.engine.spec.stats.num_verify_rows == 0
    graphs = warm.engine.runner.graphs
    if graphs is not None:
        assert graphs.replays == {}
    assert warm.state == fresh.state
    batch = prompts(warm)
    assert run(warm.llm, batch) == run(fresh.llm, batch)
    if graphs is not None:
        assert graphs.replays == fresh.engine.runner.graphs.replays != {}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_model_len=64, max_num_seqs=2, num_gpu_blocks_override=9),
        dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=512),
    ],
    ids=["small", "no-prefix-no-chunks"],
)
def test_warm_up_fits_any_engine(kwargs: dict) -> None:
    """Prompts are cut to what the engine holds; without prefix caching or chunking too."""
    warm, fresh = Built(warmup=True, **kwargs), Built(warmup=False, **kwargs)
    assert warm.steps and warm.state == fresh.state
    batch = [p[:40] for p in prompts(warm)]
    assert run(warm.llm, batch) == run(fresh.llm, batch)


def test_a_warm_up_out_of_steps_still_leaves_the_engine_fresh(
    fresh: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    warned: list[str] = []
    monkeypatch.setattr(warmup.logger, "warning", lambda msg, *args: warned.append(msg % args))
    monkeypatch.setattr(warmup, "MAX_STEPS", 10)  # stopped with requests running, one in flight
    warm = Built(warmup=True, async_scheduling=True)
    assert warned == ["warm-up stopped after 10 steps, unfinished (it is only a warm-up)"]
    assert warm.state == fresh.state


def test_the_flag() -> None:
    parser = cli.build_parser()
    assert (
        cli.engine_kwargs(parser.parse_args(["generate", "hi", "--no-warmup"]))["warmup"] is False
    )
    assert cli.engine_kwargs(parser.parse_args(["generate", "hi", "--warmup"]))["warmup"] is True
    assert "warmup" not in cli.engine_kwargs(parser.parse_args(["generate", "hi"]))
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    assert "--no-warmup" in serve.format_help()


def test_the_default_is_on_with_cuda_only() -> None:
    config = create_engine_config(None, random_model="tiny-qwen3.5", device="cpu")
    assert config.warmup is None and not warmup.should_warm_up(config)
    cuda = dataclasses.replace(config.model, device=torch.device("cuda"))
    assert warmup.should_warm_up(dataclasses.replace(config, model=cuda))
    assert not warmup.should_warm_up(dataclasses.replace(config, model=cuda, warmup=False))
    assert warmup.should_warm_up(dataclasses.replace(config, warmup=True))


@pytest.mark.gpu
def test_warm_up_on_cuda_leaves_the_engine_fresh() -> None:
    """On a GPU (where it is on by default): the Triton and fla kernels of the prefill path run
    in the warm-up, and afterwards the engine's state and outputs equal an engine built without
    it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kwargs = dict(device="cuda")
    warm, fresh = Built(warmup=True, **kwargs), Built(warmup=False, **kwargs)
    assert warm.steps and warm.before_reset["prefix_cache_hits"] > 0
    assert warm.state == fresh.state
    batch = prompts(warm)
    assert run(warm.llm, batch) == run(fresh.llm, batch)
