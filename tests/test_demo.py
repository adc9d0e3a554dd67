"""The embedded demo model: deterministic, complete, and loadable by transformers itself."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, Qwen3_5ForCausalLM

from deltaserve.loader import demo
from deltaserve.loader.demo import DEMO_MODEL_NAME, ensure_demo_model


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return ensure_demo_model()  # into DELTASERVE_CACHE_DIR (see conftest)


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path):
    return AutoTokenizer.from_pretrained(demo_dir)


def _files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_default_location_follows_env(demo_dir: Path, deltaserve_cache_dir: Path) -> None:
    assert demo_dir == deltaserve_cache_dir / DEMO_MODEL_NAME


def test_build_is_deterministic(tmp_path: Path) -> None:
    first = ensure_demo_model(tmp_path / "a")
    second = ensure_demo_model(tmp_path / "b")
    assert first == tmp_path / "a" / DEMO_MODEL_NAME
    files_a, files_b = _files(first), _files(second)
    assert files_a["model.safetensors"] == files_b["model.safetensors"]
    assert files_a == files_b
    # The build leaves nothing else behind (no temporary directories).
    assert [p.name for p in (tmp_path / "a").iterdir()] == [DEMO_MODEL_NAME]


def test_complete_dir_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = ensure_demo_model(tmp_path)

    def fail(out_dir: object) -> None:
        raise AssertionError("a complete demo model must not be rebuilt")

    monkeypatch.setattr(demo, "build_demo_model", fail)
    assert ensure_demo_model(tmp_path) == built


def test_incomplete_dir_is_rebuilt(tmp_path: Path) -> None:
    built = ensure_demo_model(tmp_path)
    expected = (built / "model.safetensors").read_bytes()
    (built / "model.safetensors").unlink()
    assert ensure_demo_model(tmp_path) == built
    assert (built / "model.safetensors").read_bytes() == expected
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_MODEL_NAME]


def test_readme_says_weights_are_random(demo_dir: Path) -> None:
    readme = (demo_dir / "README.md").read_text(encoding="utf-8")
    assert demo.DEMO_NOTICE in readme
    assert "RANDOM" in readme


def test_tokenizer_round_trips_utf8(tokenizer) -> None:
    rng = random.Random(0)
    samples = [
        "Hello, world!",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\r\n",
        "emoji 👋🏽 🧑‍🚀 flags 🇫🇷",
        "日本語のテキスト, Ελληνικά, العربية, עברית",
        "combining e\u0301 vs \u00e9, zero width \u200b joiner",
        "\x00\x01\x1b[31m control bytes \x7f",
    ]
    # Random code points from the whole Unicode range (surrogates excluded).
    for _ in range(20):
        points = [rng.randrange(0x110000) for _ in range(rng.randrange(1, 40))]
        samples.append("".join(chr(p) for p in points if not 0xD800 <= p <= 0xDFFF))
    for text in samples:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8")), text  # one token per byte, id = byte value
        assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer, demo_dir: Path) -> None:
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    assert tokenizer.convert_tokens_to_ids(names) == [256, 257, 258, 259, 260]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.encode("<|im_start|>user<think>", add_special_tokens=False) == [
        257,
        *b"user",
        259,
    ]
    # <think> is not a special token: it survives skip_special_tokens, as in Qwen3.
    assert tokenizer.decode([257, 259, 104, 260, 258], skip_special_tokens=True) == (
        "<think>h</think>"
    )
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [258, 256]


def test_chat_template_renders_chatml(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert no_prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_chat_template_enable_thinking(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

    def render(**kwargs: object) -> str:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )

    assert render() == base
    assert render(enable_thinking=True) == base
    assert render(enable_thinking=False) == base + "<think>\n\n</think>\n\n"


def test_chat_template_tools(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"c": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "5 C"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '{"type": "function", "function": {"name": "weather"' in text
    assert (
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "weather", "arguments": {"c": "Oslo"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n"
        "<tool_response>\n5 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_config(demo_dir: Path, tokenizer) -> None:
    config = AutoConfig.from_pretrained(demo_dir)
    assert config.model_type == "qwen3_5_text"
    assert config.architectures == ["Qwen3_5ForCausalLM"]
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (128, 4, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (32, 32)
    assert config.vocab_size >= len(tokenizer) and config.vocab_size % 8 == 0
    assert config.tie_word_embeddings is True
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.bos_token_id is None
    assert config.max_position_embeddings == 4096


def test_safetensors_file(demo_dir: Path) -> None:
    with safe_open(demo_dir / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied to model.embed_tokens.weight
        for name in names:
            tensor = f.get_tensor(name)
            assert tensor.dtype == torch.float32, name
            assert torch.isfinite(tensor).all(), name
            # Every weight is randomised, norms included (no all-zero or all-one tensors).
            assert tensor.unique().numel() > 1, name


def test_weights_load_into_transformers(demo_dir: Path, tokenizer) -> None:
    model, info = Qwen3_5ForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert info["error_msgs"] == []
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    with safe_open(demo_dir / "model.safetensors", framework="pt") as f:
        state = model.state_dict()
        for name in f.keys():  # what was loaded is what was written
            assert torch.equal(state[name], f.get_tensor(name)), name

    ids = tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_greedy_output_is_not_degenerate(demo_dir: Path, tokenizer) -> None:
    """The random weights are scaled so greedy decoding does not repeat one token."""
    model = Qwen3_5ForCausalLM.from_pretrained(demo_dir)
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
        )
    new_tokens = out[0, ids.shape[1] :].tolist()
    assert len(new_tokens) == 32
    assert len(set(new_tokens)) >= 8, new_tokens
