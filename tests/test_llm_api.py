"""The offline API end to end on the demo model (text prompts, chat, stops, logprobs, aborts)."""

import logging

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.loader.demo import ensure_demo_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = ensure_demo_model(tmp_path_factory.mktemp("demo-cache"))
    return LLM(str(path), device="cpu", max_model_len=256, seed=0)


def test_text_prompt_roundtrip(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    assert out.prompt == "Hello" and out.prompt_token_ids == tok.encode("Hello")
    c = out.outputs[0]
    assert len(c.token_ids) == 12 and c.finish_reason == "length"
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    text = llm.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text
    assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_stop_string_truncates_and_reports(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("abc", params)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:5]  # a stop string that certainly occurs in the greedy text
    first = full.text.find(stop)
    out = llm.generate(
        "abc", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    )
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[:first]
    inc = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert llm.generate("abc", inc)[0].outputs[0].text == full.text[: first + len(stop)]


def test_stop_token_ids(llm):
    full = llm.generate("xyz", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    ids = full[0].outputs[0].token_ids
    target = ids[5]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[target])
    c = llm.generate("xyz", params)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == target
    assert c.token_ids == ids[: ids.index(target) + 1]
    # min_tokens bans the stop token until enough tokens exist
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[target], min_tokens=10
    )
    c = llm.generate("xyz", params)[0].outputs[0]
    assert target not in c.token_ids[:10] and len(c.token_ids) >= 10


def test_logprobs_shape_and_values(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    c = llm.generate("Hi", params)[0].outputs[0]
    assert len(c.logprobs) == 5
    total = 0.0
    for tid, pos in zip(c.token_ids, c.logprobs):
        assert tid in pos and pos[tid].rank == 1  # greedy picks the top token
        ranks = sorted(lp.rank for lp in pos.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in pos.values())
        total += pos[tid].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_n_completions_and_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    a = llm.generate("seed", params)[0]
    b = llm.generate("seed", params)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_bad_request_fails_alone_and_engine_keeps_serving(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="longer than"):
        llm.generate({"prompt_token_ids": [1] * 300})
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    # a batch with one bad prompt queues nothing
    with pytest.raises(ValueError):
        llm.generate(["ok", {"prompt_token_ids": []}])
    assert not engine.has_unfinished_requests()
    out = llm.generate("still fine", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert engine.cache_usage()["kv_blocks_used"] == 0
    assert engine.cache_usage()["state_slots_used"] == 0


def test_abort_frees_blocks_and_slot(llm):
    engine = llm.llm_engine
    engine.add_request("abort-me", "some prompt", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    usage = engine.cache_usage()
    assert usage["kv_blocks_used"] > 0 and usage["state_slots_used"] == 1
    engine.abort_request("abort-me")
    assert engine.cache_usage()["kv_blocks_used"] == 0
    assert engine.cache_usage()["state_slots_used"] == 0
    assert not engine.has_unfinished_requests()


def test_runtime_stats_logging(llm, monkeypatch, caplog):
    from deltaserve.engine.stats import RuntimeStats

    monkeypatch.setenv("DELTASERVE_RUNTIME_STATS", "1")
    monkeypatch.setenv("DELTASERVE_RUNTIME_STATS_INTERVAL", "2")
    llm.llm_engine.stats = RuntimeStats()
    logging.getLogger("deltaserve").addHandler(caplog.handler)
    try:
        llm.generate(["a", "bb"], SamplingParams(max_tokens=6, ignore_eos=True))
    finally:
        logging.getLogger("deltaserve").removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "generation" in r.getMessage()]
    assert len(lines) >= 2
    assert "tok/s" in lines[0] and "KV blocks" in lines[0] and "state slots" in lines[0]
    assert "decode" in lines[0] and "prefill" in lines[0]


def test_multi_turn_chat_hits_the_prefix_cache(llm):
    """A 5-turn chat on the (hybrid) demo model: prefix caching is on by default, and from turn
    2 on the prefill computes at most the new turn's tokens (template and user message) plus
    one block, as the engine's counters say; no KV block, slot or snapshot stays held."""
    path = llm.llm_engine.config.model.path
    chat = LLM(path, device="cpu", max_model_len=512, seed=0)
    engine = chat.llm_engine
    block = engine.config.cache.block_size
    assert engine.scheduler.prefix_cache is not None
    messages = [{"role": "system", "content": "You are a terse assistant. " * 3}]
    history = 0  # tokens of the previous prompt plus its answer
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question {turn}: tell me about {turn * 7}."})
        before = engine.prefix_cache_stats()
        out = chat.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        after = engine.prefix_cache_stats()
        computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        prompt_len = len(out.prompt_token_ids)
        if turn == 0:
            assert computed == prompt_len and out.num_cached_tokens == 0
        else:
            new_turn = prompt_len - history
            assert computed <= new_turn + block, f"turn {turn + 1}: {computed} > {new_turn}"
            assert out.num_cached_tokens == prompt_len - computed
        history = prompt_len + len(out.outputs[0].token_ids)
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    assert after["prefix_cache_hits"] == 4 and after["prefix_snapshots_held"] > 0
    assert all(pool.num_used == 0 for pool in engine.scheduler.pools)


def test_prefix_caching_refused_without_snapshot_memory(llm):
    path = llm.llm_engine.config.model.path
    with pytest.raises(ValueError, match="Gated DeltaNet layers.*prefix_state_memory"):
        LLM(path, device="cpu", max_model_len=64, enable_prefix_caching=True, prefix_state_memory=0)
    off = LLM(path, device="cpu", max_model_len=64, prefix_state_memory=0)
    assert off.llm_engine.scheduler.prefix_cache is None


def test_backend_keywords_and_dict(llm):
    path = llm.llm_engine.config.model.path
    other = LLM(
        path,
        device="cpu",
        max_model_len=64,
        seed=0,
        backends={"gdn_decode": "torch"},
        attention_backend="torch",
        fused_backend="auto",
    )
    assert other.llm_engine.config.backends == {"gdn_decode": "torch", "attention": "torch"}
    runner_choice = {
        op: d.chosen.name for op, d in other.llm_engine.runner.backend_decisions.items()
    }
    assert runner_choice["gdn_decode"] == "torch" and runner_choice["attention"] == "torch"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert other.generate("Hello", params)[0].outputs[0].token_ids == (
        llm.generate("Hello", params)[0].outputs[0].token_ids
    )
    with pytest.raises(ValueError, match="unknown conv1d backend 'cuda'; choose from auto, triton"):
        LLM(path, device="cpu", conv1d_backend="cuda")
    with pytest.raises(ValueError, match="unknown op family 'gdn'"):
        LLM(path, device="cpu", backends={"gdn": "torch"})
