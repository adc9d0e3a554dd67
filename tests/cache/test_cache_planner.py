"""The cache planner: pool sizes, bytes and the capacity line for today's models, pinned."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve.cache.planner import (
    CachePlan,
    allocate_caches,
    describe_capacity,
    plan_caches,
)
from deltaserve.cache.spec import AttentionSpec, GDNSpec
from deltaserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

# Qwen3-0.6B: 28 attention layers; Qwen3.5-0.8B: 18 GDN + 6 gated attention layers (3:1)
QWEN3 = [AttentionSpec(16, 8, 128)] * 28
_GDN = GDNSpec(16, 16, 128, 128, 4)
QWEN3_5 = [_GDN, _GDN, _GDN, AttentionSpec(8, 2, 256)] * 6


def config(
    dtype=torch.bfloat16,
    state_dtype=torch.float32,
    max_model_len=4096,
    max_num_seqs=256,
    block_size=16,
    override=None,
    prefix=False,  # the tests of snapshot sizing turn it on
    prefix_state_memory=None,
) -> EngineConfig:
    model = ModelConfig("m", None, None, "Arch", dtype, torch.device("cpu"), max_model_len, None, 0)
    cache = CacheConfig(block_size, prefix, override, state_dtype, prefix_state_memory)
    return EngineConfig(model, cache, SchedulerConfig(max_num_seqs, 8192, True))


def plan(monkeypatch, specs, gib: str, **kw) -> tuple[CachePlan, str]:
    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY_GB", gib)
    cfg = config(**kw)
    p = plan_caches(specs, cfg)
    return p, describe_capacity(p, cfg)


# The figures below are what engine/cache_alloc.py gave before pools (same specs, same config).
def test_qwen3_attention_only(monkeypatch):
    p, text = plan(monkeypatch, QWEN3, "2")
    assert (p.num_blocks, p.num_slots, p.block_bytes, p.slot_bytes) == (1170, 0, 1835008, 0)
    assert p.units == {"paged": 1170}
    assert text == (
        "1169 KV blocks of 16 tokens (2.00 GiB) = 18704 tokens: "
        "4 sequences of max_model_len 4096 at once"
    )
    # enough memory: max_num_seqs full-length sequences, no more
    p, text = plan(monkeypatch, QWEN3, "64", max_num_seqs=8, state_dtype=torch.bfloat16)
    assert (p.num_blocks, p.block_bytes) == (2049, 1835008)
    assert text.startswith("2048 KV blocks of 16 tokens (3.50 GiB) = 32768 tokens: 8 sequences")
    p, _ = plan(monkeypatch, QWEN3, "64", dtype=torch.float32, max_model_len=40960)
    assert (p.num_blocks, p.block_bytes) == (18724, 3670016)


def test_qwen3_5_hybrid(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        logging.getLogger("deltaserve").addHandler(caplog.handler)
        try:
            p, text = plan(monkeypatch, QWEN3_5, "2")
        finally:
            logging.getLogger("deltaserve").removeHandler(caplog.handler)
    assert (p.num_blocks, p.num_slots, p.block_bytes, p.slot_bytes) == (
        5457,
        55,
        196608,
        19537920,
    )
    assert text == (
        "5456 KV blocks of 16 tokens (1.00 GiB) = 87296 tokens: 21 sequences of max_model_len "
        "4096 at once; 54 recurrent-state slots (1.00 GiB): at most 54 sequences of any length "
        "at once"
    )
    assert (
        "recurrent state for 256 sequences exceeds half the cache memory; "
        "at most 54 sequences run at once"
    ) in [r.getMessage() for r in caplog.records]
    p, text = plan(monkeypatch, QWEN3_5, "2", max_num_seqs=8, state_dtype=torch.bfloat16)
    assert (p.num_blocks, p.num_slots, p.block_bytes, p.slot_bytes) == (2049, 9, 196608, 10100736)
    assert text.endswith(
        "8 recurrent-state slots (0.08 GiB): at most 8 sequences of any length at once"
    )
    p, _ = plan(monkeypatch, QWEN3_5, "2", dtype=torch.float32, max_model_len=40960)
    assert (p.num_blocks, p.num_slots, p.block_bytes, p.slot_bytes) == (2687, 54, 393216, 20201472)
    p, _ = plan(monkeypatch, QWEN3_5, "64")
    assert (p.num_blocks, p.num_slots) == (65537, 257)


def test_override_and_too_small(monkeypatch):
    p, text = plan(monkeypatch, QWEN3_5, "0.5", override=700)
    assert (p.num_blocks, p.num_slots) == (700, 14)
    assert text.startswith("699 KV blocks of 16 tokens (0.13 GiB) = 11184 tokens: 2 sequences")
    with pytest.raises(ValueError) as err:
        plan(monkeypatch, QWEN3, "0.5", dtype=torch.float32, max_model_len=40960)
    assert str(err.value) == (
        "the KV cache holds 145 blocks of 16 tokens, fewer than one sequence of "
        "max_model_len=40960 needs (2560); lower max_model_len or give the cache more memory"
    )


def test_plan_properties_and_allocation(monkeypatch):
    empty = CachePlan()
    assert (empty.num_blocks, empty.num_slots, empty.block_bytes, empty.slot_bytes) == (0,) * 4
    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY_GB", "0.01")
    specs = [GDNSpec(2, 4, 8, 6, 4), AttentionSpec(4, 2, 8)]
    cfg = config(dtype=torch.float32, max_model_len=32, max_num_seqs=3, block_size=4)
    p = plan_caches(specs, cfg)
    assert (p.num_blocks, p.num_slots) == (3 * 8 + 1, 4)
    assert p.block_bytes == 2 * 4 * 2 * 8 * 4
    assert p.slot_bytes == (4 * 6 * 8 + (2 * 2 * 8 + 4 * 6) * 3) * 4
    smaller = p.with_units({"paged": 10, "slots": 2, "snapshots": 0, "unused": 5})
    assert smaller.units == {"paged": 10, "slots": 2, "snapshots": 0}
    assert smaller.unit_bytes == p.unit_bytes
    gdn, attn = allocate_caches(specs, smaller, cfg)
    assert gdn["ssm_state"].shape == (2, 4, 6, 8) and gdn["conv_state"].shape == (2, 56, 3)
    assert attn["k_cache"].shape == attn["v_cache"].shape == (10, 4, 2, 8)
    assert sum(t.numel() * t.element_size() for t in attn.values()) == 10 * p.block_bytes
    assert sum(t.numel() * t.element_size() for t in gdn.values()) == 2 * p.slot_bytes


def test_snapshots_share_the_slot_tensors(monkeypatch):
    """With prefix caching a hybrid model's snapshot pool takes a tenth of the cache memory (at
    most a quarter of what the slots left, and 4 per max_num_seqs, 64 at least) or
    prefix_state_memory, before the KV blocks; its
    units are extra rows of the slot tensors."""
    p, text = plan(monkeypatch, QWEN3_5, "2", prefix=True)
    slot = 19537920
    assert p.unit_bytes["snapshots"] == p.slot_bytes == slot
    assert p.num_slots == 55  # half the memory, as without prefix caching
    assert p.units["snapshots"] == (2 * 2**30 // 10) // slot == 10
    assert p.num_blocks == (2 * 2**30 - 55 * slot - 10 * slot) // 196608
    assert "10 prefix-state snapshots fit (0.18 GiB)" in text
    p, text = plan(monkeypatch, QWEN3_5, "2", prefix=True, prefix_state_memory=20 * slot)
    assert p.units["snapshots"] == 20
    with pytest.raises(ValueError, match=r"prefix_state_memory \(2.00 GiB\) does not fit"):
        plan(monkeypatch, QWEN3_5, "2", prefix=True, prefix_state_memory=2 * 2**30)
    cfg = config(prefix=True)
    caches = allocate_caches(QWEN3_5[:1], plan(monkeypatch, QWEN3_5, "2", prefix=True)[0], cfg)
    assert caches[0]["ssm_state"].shape[0] == 55 + 10  # slots, then snapshots
    # the default holds at most 4 snapshots per max_num_seqs (64 at least)
    p, _ = plan(monkeypatch, QWEN3_5, "64", prefix=True, max_num_seqs=8)
    assert p.units["snapshots"] == 64
    p, _ = plan(monkeypatch, QWEN3_5, "64", prefix=True, max_num_seqs=20)
    assert p.units["snapshots"] == 80
    p, _ = plan(monkeypatch, QWEN3, "2", prefix=True)  # attention only: no snapshot pool
    assert "snapshots" not in p.units


def test_kv_cache_memory_bytes_is_the_cuda_budget(monkeypatch):
    """With kv_cache_memory_bytes the CUDA cache budget is that size, whatever the other
    processes on the device hold; more than the free memory (past the activation reserve) is
    an error naming it."""
    import dataclasses

    from deltaserve.cache import planner

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 60 * gib)
    monkeypatch.setattr(planner, "activation_reserve_bytes", lambda cfg: gib)
    cfg = dataclasses.replace(config(), kv_cache_memory_bytes=3 * gib)
    assert planner._cuda_cache_budget(cfg) == 3 * gib
    with pytest.raises(ValueError, match="kv_cache_memory_bytes .* exceed"):
        planner._cuda_cache_budget(dataclasses.replace(cfg, kv_cache_memory_bytes=9.5 * gib))
    # without it: 0.9 of 80 GiB less ours (60), the others' (10) and the reserve (1)
    no_flag = dataclasses.replace(cfg, kv_cache_memory_bytes=None)
    assert planner._cuda_cache_budget(no_flag) == int(80 * gib * 0.9) - 71 * gib


def test_kv_cache_memory_bytes_on_cpu_replaces_the_env_default(monkeypatch):
    """On CPU kv_cache_memory_bytes sizes the pools in place of DELTASERVE_CACHE_MEMORY_GB."""
    import dataclasses

    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY_GB", "2")
    by_env = plan_caches(QWEN3, config())
    half = plan_caches(QWEN3, dataclasses.replace(config(), kv_cache_memory_bytes=2**30))
    assert by_env.num_blocks == 1170
    assert half.num_blocks == 2**30 // half.block_bytes < by_env.num_blocks


def test_llm_takes_kv_cache_memory_bytes(monkeypatch):
    """`LLM(kv_cache_memory_bytes=...)` reaches the planner on CPU: the same size as
    DELTASERVE_CACHE_MEMORY_GB gives the same pools, half of it fewer KV blocks, and the
    engine still generates."""
    from deltaserve import LLM, SamplingParams

    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY_GB", "0.0025")
    common = dict(
        random_model="tiny-qwen3.5", device="cpu", dtype="float32", max_model_len=4096,
        max_num_seqs=4, skip_tokenizer_init=True, enable_prefix_caching=False,
    )  # fmt: skip

    def usage(**kw) -> dict:
        return LLM(**common, **kw).llm_engine.cache_usage()

    by_env = usage()
    assert by_env["kv_blocks_total"] < 4 * 4096 // 16  # memory-bound, not capped by the lengths
    assert usage(kv_cache_memory_bytes=0.0025) == by_env
    llm = LLM(**common, kv_cache_memory_bytes=0.00125)
    assert 0 < llm.llm_engine.cache_usage()["kv_blocks_total"] < by_env["kv_blocks_total"]
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4)
    )
    assert len(out[0].outputs[0].token_ids) == 4
