"""Runtime statistics (DELTASERVE_RUNTIME_STATS=1): batch composition, tokens/s, cache usage,
and where a step's time goes: schedule / prepare / forward / sample / update."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from deltaserve import env
from deltaserve.logger import get_logger

logger = get_logger(__name__)


PHASES = ("schedule", "prepare", "forward", "sample", "update")


@dataclass
class EngineCounters:
    """Cumulative counts since the engine started (always on; /metrics and tests read them)."""

    prompt_tokens_computed: int = 0  # prompt tokens run through the model (cache hits are not)

    def count_step(self, rows: Iterable[tuple[Any, int]]) -> None:
        """Account a scheduled step's rows `(seq, num_new)` (before the scheduler advances)."""
        for seq, n in rows:
            start = seq.num_computed_tokens
            self.prompt_tokens_computed += max(0, min(start + n, seq.num_prompt_tokens) - start)

    def reset(self) -> None:
        self.prompt_tokens_computed = 0


class StepTimer:
    """Wall time per phase of a step. When enabled, each phase boundary first waits for the
    device (`sync`), so the forward's GPU time is not billed to the sampling that follows; when
    disabled it costs nothing and never syncs."""

    def __init__(self, enabled: bool, sync: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self.sync = sync
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._last = 0.0

    def start(self) -> None:
        if self.enabled:
            self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or start) was spent in `phase`."""
        if not self.enabled:
            return
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def take(self) -> dict[str, float]:
        totals, self.totals = self.totals, dict.fromkeys(PHASES, 0.0)
        return totals


class RuntimeStats:
    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.enabled = env.runtime_stats()
        self.interval = env.runtime_stats_interval()
        self.steps = 0
        self.timer = StepTimer(self.enabled, sync)
        self._reset(time.perf_counter())

    def reset(self) -> None:
        """Back to zero steps and an empty window, as at start-up."""
        self.steps = 0
        self.timer.take()
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.t0 = now
        self.prompt_tokens = 0
        self.gen_tokens = 0
        self.decode_seqs = 0
        self.prefill_seqs = 0
        self.window_steps = 0

    def record(
        self,
        num_decodes: int,
        num_prefills: int,
        prompt_tokens: int,
        gen_tokens: int,
        usage: dict[str, int],
        queue: tuple[int, int],
        prefix: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """Account one step; log every `interval` steps when enabled."""
        if not self.enabled:
            return
        self.steps += 1
        self.window_steps += 1
        self.decode_seqs += num_decodes
        self.prefill_seqs += num_prefills
        self.prompt_tokens += prompt_tokens
        self.gen_tokens += gen_tokens
        if self.window_steps < self.interval:
            return
        now = time.perf_counter()
        dt = max(now - self.t0, 1e-9)
        phases = self.timer.take()
        split = ", ".join(f"{name} {1e3 * t / self.window_steps:.2f}" for name, t in phases.items())
        logger.info("step %d: ms per step: %s", self.steps, split)
        logger.info(
            "step %d: running %d, waiting %d | per step %.1f decode + %.1f prefill seqs | "
            "prompt %.1f tok/s, generation %.1f tok/s | KV blocks %d/%d, state slots %d/%d",
            self.steps,
            queue[0],
            queue[1],
            self.decode_seqs / self.window_steps,
            self.prefill_seqs / self.window_steps,
            self.prompt_tokens / dt,
            self.gen_tokens / dt,
            usage["kv_blocks_used"],
            usage["kv_blocks_total"],
            usage["state_slots_used"],
            usage["state_slots_total"],
        )
        if prefix is not None:
            p = prefix()
            if p["prefix_cache_queries"]:
                logger.info(
                    "step %d: prefix cache: %d hits / %d queries, %d of %d prompt tokens hit | "
                    "state snapshots %d/%d held, %d taken, %d evicted",
                    self.steps,
                    p["prefix_cache_hits"],
                    p["prefix_cache_queries"],
                    p["prefix_cache_hit_tokens"],
                    p["prefix_cache_query_tokens"],
                    p["prefix_snapshots_held"],
                    p["prefix_snapshots_total"],
                    p["prefix_snapshots_taken"],
                    p["prefix_snapshots_evicted"],
                )
        self._reset(now)


def process_uptime() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            # NOTE: field 22 (starttime, clock ticks after boot) follows the command name, which
            # is parenthesised and may hold spaces: split after its closing parenthesis
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
