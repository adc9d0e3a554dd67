"""Start-up warm-up: compile the prefill path's kernels before the first request needs them.

Decode is warm once its CUDA graphs are captured (engine/cuda_graph.py), but nothing else runs
the prefill path before serving, so the first requests paid its Triton JIT compiles (and
fla-core's autotuning): on an H200 at 9B shapes the first chat turn waited 13.5 s for its first
token (66 s without prefix caching), the first prefix hits 8.7 s. Triton compiles a kernel once
per specialisation, and an int argument equal to 1 or divisible by 16 (a pointer aligned to 16
bytes) is part of it, so a new token count, row count or block-table width can compile a kernel
again mid-serving (DELTASERVE_LOG_COMPILES=1 logs each compile: ops/compile_log.py).

`warm_up` pushes dummy requests (token ids, greedy, `MAX_TOKENS` each, ids starting with
`REQUEST_PREFIX`) through the engine's own `add_request` / `step`, in waves that make the steps
serving makes (`_run` lists them): one row alone at token counts that are odd, even, a multiple
of 16, at most 16 (the decode GEMM's rows) and at most 8 (the conv kernel's smallest tile),
block tables 1 and 16 blocks wide, rows past one 64-token GDN chunk, long rows (past the `fla`
backend's split: fla-core's kernels) and a prompt split by chunked prefill; several rows at
once (3, 4 and 16 rows, short and long together, short rows holding more tokens than the split
backend's short part takes, rows filling the step's token budget); decode rows beside prefill
rows; with prefix caching, second turns that hit the first turns' snapshots (restores,
in-kernel checkpoints, the trailing snapshot a finished request leaves); and a request with
prompt logprobs. Under speculative decoding the decodes carry drafts where the proposer makes
them (a drafter model always; n-gram lookup where the output repeats the prompt, whose random
segment repeats: a trained model tends to continue it), so verify steps run too.

Afterwards the engine is as if fresh: no request, new pools and prefix cache (every KV block,
state slot and snapshot free, in their first order; no hash cached), counters, runtime and
speculative statistics and graph replay counts at zero, the sampler's generator reseeded. The
caches' tensors keep the dummy data, as they keep a finished request's. Before the requests,
where eager forwards pad their rows to buckets, cuBLAS sees every bucket of every projection
shape (engine/row_buckets.py: `prime_gemms`). The default is on for CUDA devices only
(`EngineConfig.warmup`, `--warmup / --no-warmup`): on CPU nothing compiles.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

import torch

from deltaserve.engine.row_buckets import prime_instance
from deltaserve.engine.scheduler import build_pools
from deltaserve.engine.stats import process_uptime
from deltaserve.logger import get_logger
from deltaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deltaserve.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine

logger = get_logger(__name__)

REQUEST_PREFIX = "deltaserve-warmup-"  # the dummy requests' ids (users' come after warm-up)
MAX_TOKENS = 3  # per request: the prefill's token, then decodes (beside later waves' prefills)
PERIOD = 13  # a prompt repeats a random segment of this many tokens
LONG_TOKENS = 1101  # a long row: past the `fla` backend's split (1024), an odd count
# the split prompt and the burst of rows stay below this many tokens (a larger budget is not
# filled: without chunked prefill the budget is max_model_len)
BURST_MAX_TOKENS = 16384
MAX_STEPS = 2000  # a warm-up that has not finished by then gives up (a warning), never hangs

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
PROMPT_LOGPROBS = SamplingParams(
    temperature=0,
    max_tokens=MAX_TOKENS,
    ignore_eos=True,
    detokenize=False,
    logprobs=1,
    prompt_logprobs=1,
)


def should_warm_up(config: EngineConfig) -> bool:
    """`config.warmup`, or when it is None (auto) whether the model runs on a CUDA device."""
    if config.warmup is not None:
        return config.warmup
    return config.model.device.type == "cuda"


def warm_up(engine: LLMEngine) -> None:
    """Run the dummy requests (module docstring) when `should_warm_up`, then leave the engine
    as if fresh. A kernel that fails here raises: start-up fails as the first request would."""
    if not should_warm_up(engine.config):
        return
    start = time.perf_counter()
    driver = _Driver(engine)
    if driver.max_prompt < 1:
        logger.info("warm-up skipped: the KV cache holds no prompt beside %d tokens", MAX_TOKENS)
        return
    prime_instance(engine.runner.instance, engine.config)  # cuBLAS: every row bucket's GEMMs
    try:
        _run(driver)
    except _OutOfSteps:
        logger.warning(
            "warm-up stopped after %d steps, unfinished (it is only a warm-up)", MAX_STEPS
        )
        engine.abort_request(list(engine.requests))
        while engine._in_flight is not None:  # an overlapped step's late tokens: dropped
            engine.step()
    if engine.config.model.device.type == "cuda":
        torch.cuda.synchronize()
    reset_engine(engine)
    up = process_uptime()
    logger.info(
        "warm-up: compiled the prefill path in %.1f s (%d requests)%s",
        time.perf_counter() - start,
        driver.num_requests,
        "" if up is None else f"; ready {up:.1f} s after the process started",
    )


def reset_engine(engine: LLMEngine) -> None:
    """Back to the state of a fresh engine (nothing may be running or waiting): new pools and
    prefix cache from the same plan, every count at zero, the sampler reseeded."""
    if engine.requests or engine._in_flight is not None:
        raise RuntimeError("the engine can be reset only with no request in it")
    sched, runner = engine.scheduler, engine.runner
    sched.reset(*build_pools(engine.config, runner.plan, sched.prefix_cache is not None))
    engine.counters.reset()
    engine.stats.reset()
    if engine.spec is not None:
        engine.spec.stats.reset()
    runner.instance.num_eager_forwards = 0
    for graphs in (runner.graphs, getattr(runner.proposer, "graphs", None)):
        replays = getattr(graphs, "replays", None)
        if isinstance(replays, dict):
            replays.clear()
    generator = runner.sampler.default_generator
    if generator is not None:
        generator.manual_seed(engine.config.model.seed)


class _OutOfSteps(Exception):
    pass


class _Driver:
    """Adds the dummy requests and steps the engine: waves alone (after the engine is idle) or
    overlapping (a second wave once the first has its first tokens: mixed steps)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        config = engine.config
        sched = engine.scheduler
        self.block_size = config.cache.block_size
        bm = sched.block_manager
        room = config.model.max_model_len
        if bm is not None:
            room = min(room, bm.capacity * bm.block_size)
        self.max_prompt = room - MAX_TOKENS - 1  # prompt + outputs fit a sequence and the KV
        self.max_rows = sched.max_running
        budget = config.scheduler.max_num_batched_tokens
        split = budget + 37
        self.split = split if config.scheduler.enable_chunked_prefill else None
        if self.split is not None and self.split > min(self.max_prompt, BURST_MAX_TOKENS):
            self.split = None
        rows = min(6, self.max_rows)
        # (rows, tokens each): more than the budget holds
        self.burst = (rows, min(budget, BURST_MAX_TOKENS) // rows + 51)
        # the GDN prefill backend's split by row length (ops/gdn/row_split.py), if it has one
        gdn = engine.runner.instance.kernels.gdn
        prefill = gdn.prefill if gdn is not None else None
        max_short = getattr(prefill, "max_short_tokens", None)
        short_total = getattr(prefill, "max_short_total", None)
        self.long = max(LONG_TOKENS, (max_short or 0) + 77)
        self.crowd: tuple[int, int] | None = None  # (rows, tokens): short rows sent long whole
        if max_short and short_total:
            rows = min(8, self.max_rows)
            tokens = short_total // rows + 33
            if tokens <= min(max_short, self.max_prompt) and rows * tokens <= budget:
                self.crowd = (rows, tokens)
        vocab = engine.vocab_size
        # token ids clear of the vocabulary's end (special tokens, image placeholders)
        self.low = min(16, vocab - 1)
        self.high = max(self.low + 1, vocab // 2)
        # the rows that decode beside a later wave's prefills: long enough, when speculating,
        # for a full row of drafts (k = num_speculative_tokens) once their first token is out
        spec = config.speculative
        self.decode_params = GREEDY.clone()
        self.decode_params.max_tokens += spec.num_speculative_tokens if spec is not None else 0
        self.rng = random.Random(0)
        self.num_requests = 0
        self.steps = 0
        self.tokens: dict[str, list[int]] = {}  # request id -> prompt, then + its output
        self.prompt_len: dict[str, int] = {}

    # ---- prompts -------------------------------------------------------------------------
    def prompt(self, n: int) -> list[int]:
        """A new prompt of n tokens (at most `max_prompt`): a random segment, repeated."""
        n = max(1, min(n, self.max_prompt))
        segment = [self.rng.randrange(self.low, self.high) for _ in range(PERIOD)]
        return (segment * (n // PERIOD + 1))[:n]

    def turn(self, rid: str, n: int) -> list[int] | None:
        """The next chat turn of finished request `rid`: its prompt and output, then n new
        tokens (fewer where max_prompt says so; None when none fit)."""
        base = self.tokens[rid]
        n = min(n, self.max_prompt - len(base))
        return base + self.prompt(n) if n >= 1 else None

    # ---- waves ---------------------------------------------------------------------------
    def alone(self, prompts: list, params: SamplingParams = GREEDY) -> list[str]:
        """Run `prompts` (None entries skipped) on an idle engine to the end."""
        self.drain()
        rids = self.submit(prompts, params)
        self.drain()
        return rids

    def overlap(self, first: list, then: list) -> tuple[list[str], list[str]]:
        """Run `first` on an idle engine, add `then` once every `first` request has its first
        token (so `first`'s decodes share steps with `then`'s prefills), run both to the end."""
        self.drain()
        a = self.submit(first, self.decode_params)
        while self.engine.has_unfinished_requests() and any(
            len(self.tokens[rid]) == self.prompt_len[rid] for rid in a
        ):
            self.step()
        b = self.submit(then, GREEDY)
        self.drain()
        return a, b

    def submit(self, prompts: list, params: SamplingParams) -> list[str]:
        rids = []
        for ids in prompts:
            if ids is None:
                continue
            rid = f"{REQUEST_PREFIX}{self.num_requests}"
            self.engine.add_request(rid, {"prompt_token_ids": ids}, params)
            self.tokens[rid] = list(ids)
            self.prompt_len[rid] = len(ids)
            self.num_requests += 1
            rids.append(rid)
        return rids

    def step(self) -> None:
        if self.steps >= MAX_STEPS:
            raise _OutOfSteps
        self.steps += 1
        for out in self.engine.step():
            done = out.prompt_token_ids + out.outputs[0].token_ids
            self.tokens[out.request_id] = done

    def drain(self) -> None:
        """Step until no request is left (and no overlapped step is in flight)."""
        while self.engine.has_unfinished_requests() or self.engine._in_flight is not None:
            self.step()


def _run(d: _Driver) -> None:
    """The waves (module docstring). Lengths that do not fit max_model_len or the KV cache
    are cut to fit."""
    bs = d.block_size
    # one row alone: <= 8 and <= 16 tokens; odd, multiple of 16 and even counts, the first
    # decode of the odd one ending a block (a trailing snapshot); a block table 16 blocks wide;
    # rows past one 64-token chunk; a long row; a split prompt
    d.alone([d.prompt(7)])
    d.alone([d.prompt(11)])
    trail = d.alone([d.prompt(max(1, 48 // bs) * bs - 1)])
    for n in (48, 50, 16 * bs - 6):
        d.alone([d.prompt(n)])
    chunked = d.alone([d.prompt(301)])
    d.alone([d.prompt(d.long)])
    if d.split is not None:
        d.alone([d.prompt(d.split)])
    # several rows: 3 short, then one more beside their decodes; 4 short and chunked; 16, then
    # two more beside their decodes; short rows crowded into the long kernel; short and long;
    # rows that fill the step's token budget (a burst of first turns)
    d.overlap([d.prompt(n) for n in (5, 23, 61)], [d.prompt(37)])
    four = d.alone([d.prompt(n) for n in (19, 64, 145, 90)])
    rows = [d.prompt(9 + 2 * i) for i in range(min(16, max(1, d.max_rows - 2)))]
    sixteen, _ = d.overlap(rows, [d.prompt(29), d.prompt(130)])
    if d.crowd is not None:
        n, tokens = d.crowd
        d.alone([d.prompt(tokens) for _ in range(n)])
    d.alone([d.prompt(40), d.prompt(d.long + 16)])
    n, tokens = d.burst
    d.alone([d.prompt(tokens) for _ in range(n)])
    # second turns: prefix hits (at a trailing snapshot; with checkpoints inside the new
    # tokens; beside a decode row); without prefix caching, prompts that share a prefix
    d.alone([d.turn(rid, 21) for rid in trail])
    d.alone([d.turn(rid, n) for rid, n in zip(four, (150, 7, 70, 33), strict=True)])
    d.overlap(
        [d.turn(rid, 45) for rid in chunked], [d.turn(rid, 5 + i) for i, rid in enumerate(sixteen)]
    )
    d.alone([d.prompt(40)], PROMPT_LOGPROBS)
