"""vLLM's flags and keywords: the engine flags are generated from create_engine_config's keywords,
so the CLI, `LLM()` and `serve` accept the same settings."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve import cli
from deltaserve.engine_flags import ENGINE_FLAGS, EngineFlag

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE_COMMANDS = ["generate", "chat", "serve"]
VLLM_SERVE_ARGV = [
    "serve",
    "models/tiny",
    "--enable-prefix-caching",
    "--max-num-batched-tokens",
    "512",
    "--seed",
    "3",
    "--tokenizer",
    "tok/",
    "--chat-template",
    "t.jinja",
    "--trust-remote-code",
    "--dtype",
    "half",
]


def _keywords() -> dict[str, inspect.Parameter]:
    from deltaserve.config import create_engine_config

    params = inspect.signature(create_engine_config).parameters
    return {n: p for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}


def _options(command: str) -> dict[str, str]:
    """option string -> dest, of one command's parser."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {opt: a.dest for a in sub._actions for opt in a.option_strings}


def test_every_engine_keyword_has_a_flag_and_every_flag_a_keyword() -> None:
    assert set(ENGINE_FLAGS) == set(_keywords())


def test_flag_defaults_are_the_engine_defaults() -> None:
    for keyword, param in _keywords().items():
        spec = ENGINE_FLAGS[keyword]
        if isinstance(spec, EngineFlag) and spec.default is not None:
            assert spec.default == param.default, keyword


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_flag_is_on_every_engine_command(command: str) -> None:
    options = _options(command)
    for keyword, spec in ENGINE_FLAGS.items():
        if isinstance(spec, EngineFlag):
            assert options.get(spec.flag(keyword)) == keyword, (command, keyword)
    assert options["--model"] == "model"


def test_vllm_serve_flags_parse_and_reach_the_engine() -> None:
    args = cli.build_parser().parse_args(VLLM_SERVE_ARGV)
    kw = cli.engine_kwargs(args)
    assert args.model == "models/tiny"
    expected = {
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 512,
        "seed": 3,
        "tokenizer": "tok/",
        "chat_template": "t.jinja",
        "trust_remote_code": True,
        "dtype": "half",
    }
    assert {k: kw[k] for k in expected} == expected
    assert set(kw) <= set(_keywords()) | {f"{op}_backend" for op in _backend_ops()}
    no_prefix = cli.build_parser().parse_args(["serve", "--no-enable-prefix-caching"])
    assert cli.engine_kwargs(no_prefix)["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in cli.engine_kwargs(
        cli.build_parser().parse_args(["serve"])
    )


def _backend_ops() -> list[str]:
    from deltaserve.backends import OP_FAMILIES

    return list(OP_FAMILIES)


def test_serve_help_lists_the_vllm_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deltaserve.cli", "serve", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in VLLM_SERVE_ARGV[2:]:
        if flag.startswith("--"):
            assert flag in out, flag


def test_generate_flags_reach_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    import deltaserve.llm

    created: list[dict] = []

    class FakeLLM:
        def __init__(self, model: str, **kwargs: object) -> None:
            created.append({"model": model, **kwargs})
            raise ValueError("stop here")

    monkeypatch.setattr(deltaserve.llm, "LLM", FakeLLM)
    argv = ["generate", "/m", "Hi", "--dtype", "bf16", "--seed", "5", "--trust-remote-code"]
    assert cli.main(argv) == 1
    assert created[0]["model"] == "/m" and created[0]["dtype"] == "bf16"
    assert created[0]["seed"] == 5 and created[0]["trust_remote_code"] is True


def test_llm_accepts_vllm_keywords_on_the_demo_model(tmp_path: Path) -> None:
    from deltaserve import LLM, SamplingParams
    from deltaserve.loader.demo import ensure_demo_model

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    llm = LLM(
        str(ensure_demo_model()),
        device="cpu",
        max_model_len=64,
        trust_remote_code=True,
        chat_template=str(template),
        tokenizer=str(ensure_demo_model()),
        seed=1,
    )
    assert llm.llm_engine.config.model.seed == 1
    out = llm.chat([{"role": "user", "content": "ping"}], SamplingParams(max_tokens=1))
    assert out[0].prompt == "<<ping>>"


def test_chat_template_text_and_missing_file() -> None:
    from deltaserve.config import read_chat_template

    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="chat template file not found: nope.jinja"):
        read_chat_template("nope.jinja")


def test_dtype_half_is_float16() -> None:
    import torch

    from deltaserve.config import resolve_dtype

    for name in ("half", "fp16"):
        assert resolve_dtype(name, None, torch.device("cpu")) == torch.float16
    assert resolve_dtype("bf16", None, torch.device("cpu")) == torch.bfloat16
