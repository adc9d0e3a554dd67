"""Images in the engine: prefix caching keyed by image content, the encoder cache and the
per-step encoder budget, limit_mm_per_prompt, and bad inputs (ValueError, nothing leaked)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vl_models import build_vl_model, image, image_prompt  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.multimodal.encoder_cache import EncoderCache  # noqa: E402
from deltaserve.multimodal.limits import parse_limit_mm_per_prompt  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model_dir, oracle = build_vl_model("qwen3_5_vl", tmp_path_factory.mktemp("vl"))
    return model_dir, oracle.config


def _llm(model_dir, **kw) -> LLM:
    args = dict(
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=4,
        block_size=16,
        skip_tokenizer_init=True,
    )
    args.update(kw)
    return LLM(str(model_dir), **args)


def _req(config, images, text=(40, 41, 42)):
    parts = [[7]] + [p for _ in images for p in ("IMG", list(text))] + [list(range(50, 90))]
    return {"prompt_token_ids": image_prompt(config, parts), "multi_modal_data": {"image": images}}


def _run(llm, prompt):
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    return out


def test_prefix_cache_keys_on_image_content(vl):
    model_dir, config = vl
    llm = _llm(model_dir)
    cold = _llm(model_dir, enable_prefix_caching=False)
    x, y = image(37, 53, seed=1), image(37, 53, seed=2)  # same size: same placeholder ids
    first = _run(llm, _req(config, [x]))
    again = _run(llm, _req(config, [x]))
    other = _run(llm, _req(config, [y]))
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens > 0  # same image: hit
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.prompt_token_ids == first.prompt_token_ids  # only the pixels differ
    # the image starts in the first block: a different image cannot hit any block
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == _run(cold, _req(config, [y])).outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids  # the image matters


def test_encoder_runs_once_per_image(vl):
    """Chunked prefill (16 tokens) splits the image over several steps: encoded once; a second
    request with the same image while it is cached is not encoded again."""
    model_dir, config = vl
    llm = _llm(model_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    cache = llm.llm_engine.runner.encoder_cache
    x = image(37, 53, seed=1)
    _run(llm, _req(config, [x]))
    assert cache.num_encoded == 1
    _run(llm, _req(config, [x]))
    assert cache.num_encoded == 1
    assert cache.num_pinned == 0  # finished requests unpin their images


def test_encoder_budget_splits_images_across_steps(vl):
    """With a budget below two images, the second waits for the next step; output unchanged."""
    model_dir, config = vl
    prompt = _req(config, [image(37, 53, seed=1), image(45, 29, seed=3)])
    want = _run(_llm(model_dir, enable_prefix_caching=False), prompt)
    llm = _llm(model_dir, enable_prefix_caching=False)
    sched = llm.llm_engine.scheduler
    sched.encoder_budget = 40  # the images take 35 and 24 tokens
    seen = []
    original = sched.schedule

    def spy():
        batch = original()
        seen.extend(n for _, n in batch.items)
        return batch

    sched.schedule = spy
    got = _run(llm, prompt)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    first_end = want.prompt_token_ids.index(config.image_token_id)
    second = [i for i, t in enumerate(want.prompt_token_ids) if t == config.image_token_id][35]
    assert first_end < seen[0] <= second  # the first step stops before the second image


def test_bad_inputs_fail_cleanly(vl, tmp_path):
    model_dir, config = vl
    llm = _llm(model_dir, limit_mm_per_prompt="image=1")
    engine = llm.llm_engine
    x = image(20, 20, seed=1)
    one = image_prompt(config, [[5], "IMG", [6]])
    cases = [
        ({"prompt_token_ids": one + one, "multi_modal_data": {"image": [x]}}, "placeholder"),
        ({"prompt_token_ids": one + one, "multi_modal_data": {"image": [x, x]}}, "limit"),
        ({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": x}}, "placeholder"),
        ({"prompt_token_ids": one, "multi_modal_data": {"image": "x.png"}}, "PIL"),
        ({"prompt_token_ids": one, "multi_modal_data": {"video": [x]}}, "multi_modal_data"),
        ({"prompt_token_ids": one}, "no images were given"),
        ({"prompt_token_ids": one, "multi_modal_data": {"image": image(20, 20, 1)}}, None),
    ]
    for prompt, match in cases[:-1]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", prompt, GREEDY)
    with pytest.raises(ValueError, match="placeholder"):  # generate: nothing queued
        llm.generate([cases[-1][0], cases[0][0]], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.runner.encoder_cache.num_pinned == 0
    assert engine.scheduler.block_manager.num_used_blocks == 0
    # and the engine still serves
    assert len(_run(llm, cases[-1][0]).outputs[0].token_ids) == 6


def test_text_only_model_refuses_images(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_models import build_model

    model_dir, _ = build_model("qwen3_5_r2_g3", tmp_path / "m", load_oracle=False)
    llm = _llm(model_dir)
    with pytest.raises(ValueError, match="no vision tower"):
        llm.generate(
            {"prompt_token_ids": [5, 6], "multi_modal_data": {"image": image(8, 8, 0)}},
            GREEDY,
            use_tqdm=False,
        )
    assert not llm.llm_engine.has_unfinished_requests()


def test_image_limit_zero_skips_the_tower(vl):
    model_dir, config = vl
    llm = _llm(model_dir, limit_mm_per_prompt={"image": 0})
    assert llm.llm_engine.runner.encoder_cache is None
    assert getattr(llm.llm_engine.runner.model, "visual", None) is None
    with pytest.raises(ValueError, match="image=0"):
        llm.generate(
            {"prompt_token_ids": image_prompt(config, ["IMG"]), "multi_modal_data": {"image": []}},
            GREEDY,
            use_tqdm=False,
        )


def test_parse_limit_mm_per_prompt():
    assert parse_limit_mm_per_prompt("image=3") == {"image": 3}
    assert parse_limit_mm_per_prompt('{"image": 2}') == {"image": 2}
    assert parse_limit_mm_per_prompt({"image": 0, "video": 0}) == {"image": 0}
    assert parse_limit_mm_per_prompt(None)["image"] > 0
    for bad, match in [
        ("image", "MODALITY=N"),
        ("image=x", "not an integer"),
        ("audio=1", "unknown modality"),
        ("video=2", "video"),
        ("image=-1", ">= 0"),
        ("{bad", "JSON"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_limit_mm_per_prompt(bad)


def test_encoder_cache_lru_and_pins():
    import torch

    cache = EncoderCache(10)
    cache.pin(["a"])
    cache.put("a", torch.zeros(4, 2))
    cache.put("b", torch.zeros(4, 2))
    cache.get("b")
    cache.put("c", torch.zeros(4, 2))  # 12 > 10: b is the oldest unpinned (a is pinned)
    assert "a" in cache and "b" not in cache and "c" in cache
    cache.unpin(["a"])
    cache.put("d", torch.zeros(4, 2))  # a is now evictable and the oldest
    assert "a" not in cache and {"c", "d"} <= {k for k in ("c", "d") if k in cache}
    assert cache.num_tokens == 8 and cache.num_encoded == 3 + 1


def test_no_image_reasons():
    """Tensor parallelism and speculative decoding refuse images with a reason (the tower is
    not built); so do text-only models and image=0."""
    from types import SimpleNamespace

    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    from deltaserve.multimodal.limits import no_image_reason

    def config(hf, tp=1, spec=None, limit=2):
        model = SimpleNamespace(hf_config=hf, architecture="X", random_model="r", path="")
        return SimpleNamespace(
            model=model,
            limit_mm_per_prompt={"image": limit},
            tensor_parallel_size=tp,
            speculative=spec,
        )

    vl = Qwen3_5Config()
    assert no_image_reason(config(vl)) is None
    assert "tensor parallelism" in no_image_reason(config(vl, tp=2))
    assert "speculative" in no_image_reason(config(vl, spec=object()))
    assert "image=0" in no_image_reason(config(vl, limit=0))
    assert "no vision tower" in no_image_reason(config(Qwen3_5TextConfig()))
