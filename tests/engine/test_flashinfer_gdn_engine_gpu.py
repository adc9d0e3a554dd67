"""The engine with FlashInfer's GDN decode (`--gdn-decode-backend flashinfer`) in every mode, on
tiny Qwen3.5 checkpoints whose GDN heads are 128 wide (the only size its kernels serve), bf16
weights and activations (its kernels read bf16), float32 state unless said (`pytest -m gpu`).

Greedy tokens equal the Triton decode's, except at near-ties: bf16 rounding of the layer output
may differ, so a sequence may part ways where the reference's two best logprobs are within
NEAR_TIE (and is compared no further); before that, the tokens' logprobs agree within
LOGPROB_TOL. Modes: decode CUDA graphs and eager, overlapped decode
(equal to the same backend without overlap, exactly), prefix-cache hits (equal to misses),
speculative decoding (verify rows of 1 + k tokens through FlashInfer's MTP kernels; equal to
decoding without drafts), and the bfloat16 state pool.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_models import ModelSpec, _qwen3_5_text_kwargs, build_model  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.backend_checks import check_flashinfer_gdn  # noqa: E402
from deltaserve.cache.spec import GDNSpec  # noqa: E402
from deltaserve.capabilities import Capabilities  # noqa: E402
from deltaserve.spec.proposer import Draft  # noqa: E402
from deltaserve.spec.registry import ProposerMethod, register_proposer  # noqa: E402


def _reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    caps = Capabilities(
        torch.device("cuda"), torch.bfloat16, torch.float32, 16, (), (GDNSpec(2, 4, 128, 128, 4),)
    )
    reason = check_flashinfer_gdn(caps)
    return None if reason is None else f"flashinfer GDN decode unavailable: {reason}"


REASON = _reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

NEAR_TIE = 0.05  # nats between the reference's two best tokens (the random models are flat)
LOGPROB_TOL = 0.05  # nats: bf16 rounding of the layer outputs
VOCAB = 256

# GDN K = V = 128; value / key head ratios 2 and 3 (one tied)
SPECS = [
    ModelSpec(
        "fi_gdn_r2",
        "qwen3_5",
        _qwen3_5_text_kwargs(
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
        ),
        dtype="bfloat16",
    ),
    ModelSpec(
        "fi_gdn_r3_tied",
        "qwen3_5",
        _qwen3_5_text_kwargs(
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
        ),
        tie_word_embeddings=True,
        dtype="bfloat16",
        seed=1,
    ),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each spec's checkpoint, built on first use."""
    paths: dict[str, Path] = {}

    def get(spec: ModelSpec) -> Path:
        if spec.name not in paths:
            paths[spec.name], _ = build_model(spec, tmp_path_factory.mktemp(spec.name), False)
        return paths[spec.name]

    return get


@pytest.fixture(scope="module")
def model_dir(built) -> Path:
    """The ratio-2 checkpoint: the mode tests run on it (each mode costs engine builds)."""
    return built(SPECS[0])


def _prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB - 4, (int(length),), generator=gen).tolist()
        for length in torch.randint(5, 40, (n,), generator=gen)
    ]


def _llm(model_dir: Path, backend: str, **kw) -> LLM:
    args = dict(
        device="cuda",
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        seed=0,
        attention_backend="triton",
        gdn_decode_backend=backend,
    )
    args.update(kw)
    llm = LLM(str(model_dir), **args)
    assert llm.llm_engine.runner.backend_decisions["gdn_decode"].chosen.name == backend
    return llm


def _run(llm: LLM, prompts, max_tokens: int = 24, logprobs: bool = True):
    """[(token ids, [logprobs of the top 2 per position] or None)] per prompt, greedy."""
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2 if logprobs else None
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        tops = None
        if logprobs:
            tops = [sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in c.logprobs]
        result.append((list(c.token_ids), tops))
    return result


def assert_equal_but_near_ties(got, want) -> int:
    """Token lists equal, or parting only where `want`'s two best logprobs are within NEAR_TIE;
    where `got` has logprobs too, those of the shared tokens agree within LOGPROB_TOL. Returns
    how many sequences parted (at near-ties)."""
    parted = 0
    for i, ((g, g_tops), (w, tops)) in enumerate(zip(got, want, strict=True)):
        j = next((n for n, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
        if g_tops is not None:
            diffs = [abs(g_tops[n][0] - tops[n][0]) for n in range(j)]
            assert max(diffs, default=0.0) < LOGPROB_TOL, f"sequence {i}: logprobs differ {diffs}"
        if j == len(w):
            assert g == w
            continue
        gap = tops[j][0] - tops[j][1]
        assert gap < NEAR_TIE, f"sequence {i} parts at token {j}, not a near-tie (gap {gap:.3f})"
        parted += 1
    return parted


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gpu_flashinfer_equals_triton(built, spec, eager):
    model_dir = built(spec)
    prompts = _prompts()
    want = _run(_llm(model_dir, "triton", enforce_eager=eager), prompts)
    llm = _llm(model_dir, "flashinfer", enforce_eager=eager)
    assert (llm.llm_engine.runner.graphs is None) == eager  # graphs: the backend is capturable
    assert_equal_but_near_ties(_run(llm, prompts), want)


def test_gpu_overlapped_decode_equals_synchronous(model_dir):
    """Overlapped decode (async scheduling; no logprobs, which would drain it) gives exactly the
    tokens of the same backend stepping synchronously."""
    prompts = _prompts(seed=1)
    sync = _llm(model_dir, "flashinfer", async_scheduling=False)
    want = _run(sync, prompts, max_tokens=40, logprobs=False)
    del sync
    overlapped = _llm(model_dir, "flashinfer", async_scheduling=True)
    got = _run(overlapped, prompts, max_tokens=40, logprobs=False)
    assert [t for t, _ in got] == [t for t, _ in want]


def test_gpu_prefix_cache_hits_equal_triton(model_dir):
    """Three conversations sharing a system prompt, two turns, prefix caching on: with the
    states restored from snapshots into slots (hits) the flashinfer decode gives the tokens of
    the triton decode on the same hits. (Hit against miss changes the prefill's chunking, which
    in bf16 weights moves logprobs by ~0.05 whatever the decode backend; that equality is
    tested in float32 on CPU, tests/engine/test_hybrid_prefix_cache*.py.)"""
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(3, VOCAB - 4, (150,), generator=gen).tolist()
    users = [torch.randint(3, VOCAB - 4, (n,), generator=gen).tolist() for n in (9, 13, 21)]
    ref = _llm(model_dir, "triton", prefix_snapshot_interval=64)
    hit = _llm(model_dir, "flashinfer", prefix_snapshot_interval=64)
    histories = [list(system) for _ in users]
    for turn in range(2):
        prompts = [h + u[: 5 + turn] for h, u in zip(histories, users)]
        want = _run(ref, prompts, max_tokens=16)
        assert_equal_but_near_ties(_run(hit, prompts, max_tokens=16), want)
        histories = [p + tokens for p, (tokens, _) in zip(prompts, want)]
    stats = hit.llm_engine.prefix_cache_stats()
    assert stats["prefix_cache_hits"] >= 3, stats
    for pool in hit.llm_engine.scheduler.pools:
        assert pool.num_used == 0, pool.kind


def _register_lenient() -> None:
    """Register "fi_lenient_oracle": drafts the reference continuation while the sequence still
    follows it (all right, or all wrong with option j = 0), none once it has parted at a
    near-tie (the stub proposers of tests/spec assert that it never parts)."""
    from deltaserve.spec.proposer import Proposer

    class LenientOracle(Proposer):
        def __init__(self, spec, config) -> None:
            super().__init__(spec, config)
            self.table = {tuple(p): list(c) for p, c in spec.options["continuations"]}
            self.wrong = spec.options["j"] == 0

        def propose(self, seqs, max_drafts):
            out = []
            for seq, k in zip(seqs, max_drafts, strict=True):
                full = list(seq.prompt_token_ids) + self.table[tuple(seq.prompt_token_ids)]
                pos = len(seq.token_ids)
                if seq.token_ids != full[:pos]:
                    out.append(Draft([]))
                    continue
                drafts = full[pos : pos + k]
                if self.wrong:
                    drafts = [(t + 1) % (VOCAB - 8) + 3 for t in drafts]
                out.append(Draft(drafts))
            return out

    register_proposer(ProposerMethod("fi_lenient_oracle", LenientOracle, ("continuations", "j")))


@pytest.mark.parametrize("right", [True, False], ids=["accepted", "rejected"])
def test_gpu_speculation_equals_plain_decode(model_dir, right):
    """Verify rows of 1 + 7 tokens run FlashInfer's MTP kernels (in graphs keyed (batch, 8));
    rejected drafts roll the state back by replay: the output is that of plain decoding."""
    _register_lenient()
    prompts = _prompts(n=3, seed=2)
    plain = _llm(model_dir, "flashinfer")
    want = _run(plain, prompts, max_tokens=32)
    del plain
    spec = {
        "method": "fi_lenient_oracle",
        "num_speculative_tokens": 7,
        "continuations": [(tuple(p), w) for p, (w, _) in zip(prompts, want, strict=True)],
        "j": 7 if right else 0,
    }
    llm = _llm(model_dir, "flashinfer", speculative_config=spec, async_scheduling=False)
    got = _run(llm, prompts, max_tokens=32, logprobs=False)
    assert_equal_but_near_ties(got, want)
    stats = llm.llm_engine.spec.stats
    assert stats.num_verify_rows > 0
    if right:
        assert stats.num_accepted_tokens > 0


def test_gpu_bfloat16_state_equals_triton(model_dir):
    """The bf16 pool (FlashInfer's bf16-state kernels) against the Triton decode on the same
    bf16 pool."""
    prompts = _prompts(seed=4)
    want = _run(_llm(model_dir, "triton", state_dtype="bfloat16"), prompts)
    got = _run(_llm(model_dir, "flashinfer", state_dtype="bfloat16"), prompts)
    assert_equal_but_near_ties(got, want)
