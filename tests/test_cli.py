"""The `deltaserve` command line: argument wiring, streaming, and end to end on the demo model."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltaserve import cli
from deltaserve.loader.demo import DEMO_NOTICE, ensure_demo_model
from deltaserve.outputs import CompletionOutput, RequestOutput

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["generate", "chat", "backends"]


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", COMMANDS)
def test_subcommand_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"deltaserve {command}" in out
    assert "--model" in out and "--device" in out


def test_no_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_generate_arguments() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "Hi there"])
    assert (args.prompt, args.model, args.device, args.dtype) == ("Hi there", None, "auto", "auto")
    assert (args.max_tokens, args.temperature, args.max_model_len) == (64, 0.0, None)
    assert (args.top_p, args.top_k, args.seed, args.chat) == (None, None, None, False)
    args = parser.parse_args(
        "generate x --model m --device cpu --dtype bfloat16 --max-model-len 128 --max-tokens 5 "
        "--temperature 0.7 --top-p 0.9 --top-k 20 --seed 3 --chat --no-thinking".split()
    )
    assert (args.model, args.device, args.dtype, args.max_model_len) == (
        "m",
        "cpu",
        "bfloat16",
        128,
    )
    assert (args.max_tokens, args.temperature, args.top_p, args.top_k) == (5, 0.7, 0.9, 20)
    assert (args.seed, args.chat, args.no_thinking) == (3, True, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--device", "tpu"])


def test_chat_and_backends_arguments() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["chat", "--dtype", "float32", "--system", "Be brief."])
    assert (args.model, args.dtype, args.system, args.max_tokens) == (
        None,
        "float32",
        "Be brief.",
        256,
    )
    args = parser.parse_args(["backends", "--model", "m", "--device", "cuda"])
    assert (args.model, args.device) == ("m", "cuda")


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from deltaserve import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['generate', '--help'])\n"
        "assert 'torch' not in sys.modules, 'deltaserve --help imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


# --- streaming, against a scripted engine ------------------------------------------------------


class _ScriptedEngine:
    """Emits a fixed sequence of cumulative texts for the one request it is given."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.requests: list[tuple[str, object, object]] = []
        self.step_index = 0

    def add_request(self, request_id: str, prompt: object, params: object) -> None:
        self.requests.append((request_id, prompt, params))

    def has_unfinished_requests(self) -> bool:
        return self.step_index < len(self.texts)

    def step(self) -> list[RequestOutput]:
        i = self.step_index
        self.step_index += 1
        last = self.step_index == len(self.texts)
        request_id = self.requests[-1][0]
        other = RequestOutput("other", None, [1], [CompletionOutput(0, "IGNORED", [9])])
        completion = CompletionOutput(
            0, self.texts[i], list(range(i + 1)), finish_reason="length" if last else None
        )
        mine = RequestOutput(request_id, "Hi", [1, 2, 3], [completion], finished=last)
        return [other, mine]

    def abort_request(self, request_id: str) -> None:  # pragma: no cover - not reached
        raise AssertionError("nothing to abort")


def _fake_llm_class(texts: list[str], created: list[dict]):
    class FakeLLM:
        def __init__(self, model: str, **kwargs: object) -> None:
            created.append({"model": model, **kwargs})
            self.llm_engine = _ScriptedEngine(texts)

    return FakeLLM


def test_generate_streams_deltas(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import deltaserve.llm

    created: list[dict] = []
    monkeypatch.setattr(
        deltaserve.llm, "LLM", _fake_llm_class(["He", "Hello", "Hello", "Hello!"], created)
    )
    argv = "generate Hi --model /m --device cpu --dtype float32 --max-model-len 99 --max-tokens 4"
    assert cli.main([*argv.split(), "--top-k", "5", "--seed", "7"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello!\n"
    assert DEMO_NOTICE not in captured.err  # --model given: no demo
    assert "prompt 3 tok, generated 4 tok" in captured.err and "tok/s" in captured.err
    assert len(created) == 1
    expected = {"model": "/m", "device": "cpu", "dtype": "float32", "max_model_len": 99}
    assert {k: created[0][k] for k in expected} == expected
    assert created[0]["attention_backend"] == "auto" and created[0]["enforce_eager"] is False


def test_generate_uses_demo_model_by_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import deltaserve.llm

    created: list[dict] = []
    monkeypatch.setattr(deltaserve.llm, "LLM", _fake_llm_class(["x"], created))
    assert cli.main(["generate", "Hi"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(DEMO_NOTICE)
    assert created[0]["model"] == str(ensure_demo_model())


def test_stream_completion_passes_prompt_and_params() -> None:
    engine = _ScriptedEngine(["a", "ab"])
    out = io.StringIO()
    final, first_token_s = cli.stream_completion(
        SimpleNamespace(llm_engine=engine), "the prompt", "PARAMS", out
    )
    assert out.getvalue() == "ab\n"
    assert final.finished and final.outputs[0].text == "ab"
    assert first_token_s is not None and first_token_s >= 0
    assert engine.requests[0][1:] == ("the prompt", "PARAMS")


def test_printable_escapes_terminal_controls() -> None:
    assert cli._printable("plain text\twith tab\n") == "plain text\twith tab\n"
    assert cli._printable("a\x1b[2Jb\rc\x07") == "a\\x1b[2Jb\\x0dc\\x07"
    assert cli._printable("emoji 👋 and é") == "emoji 👋 and é"


def test_backends_wiring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import deltaserve.backends

    calls = []

    def fake_table(model, device, dtype, forced, state_dtype) -> str:
        calls.append((model, device, dtype, forced, state_dtype))
        return "TABLE"

    monkeypatch.setattr(deltaserve.backends, "format_backend_table", fake_table)
    argv = ["backends", "--model", "/m", "--device", "cpu", "--gdn-decode-backend", "torch"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "TABLE\n"
    forced = {
        "attention": "auto",
        "gdn_prefill": "auto",
        "gdn_decode": "torch",
        "gdn_replay": "auto",
        "conv1d": "auto",
        "fused": "auto",
        "decode_gemm": "auto",
        "moe": "auto",
        "mla": "auto",
    }
    assert calls == [("/m", "cpu", "auto", forced, "float32")]


def test_engine_flags_reach_llm() -> None:
    args = cli.build_parser().parse_args(
        [
            "generate",
            "hi",
            "--attention-backend",
            "torch",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.5",
            "--state-dtype",
            "bfloat16",
            "--tensor-parallel-size",
            "2",
        ]
    )
    kw = cli.engine_kwargs(args)
    assert kw["tensor_parallel_size"] == 2
    assert kw["attention_backend"] == "torch" and kw["gdn_decode_backend"] == "auto"
    assert kw["enforce_eager"] is True and kw["gpu_memory_utilization"] == 0.5
    assert kw["state_dtype"] == "bfloat16"


def test_forced_backend_that_cannot_serve_stops_start_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["backends", "--device", "cpu", "--gdn-decode-backend", "triton"]) == 1
    err = capsys.readouterr().err
    assert "gdn_decode backend 'triton' cannot serve this model: no CUDA device" in err
    argv = ["generate", "hi", "--device", "cpu", "--attention-backend", "flashinfer"]
    assert cli.main(argv) == 1
    assert "attention backend 'flashinfer' cannot serve this model" in capsys.readouterr().err


# --- end to end on the demo model --------------------------------------------------------------


def test_backends_on_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("deltaserve.backends")
    assert cli.main(["backends", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "Qwen3_5ForCausalLM" in captured.out
    assert captured.err.startswith(DEMO_NOTICE)


def test_generate_matches_transformers_greedy(capsys: pytest.CaptureFixture[str]) -> None:
    """`deltaserve generate "Hello"` streams exactly what transformers' own Qwen3.5 code
    generates greedily from the demo weights."""
    pytest.importorskip("deltaserve.llm")
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    model_dir = ensure_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
        )
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    capsys.readouterr()  # drop what transformers printed

    assert cli.main(["generate", "Hello", "--max-tokens", "16", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert captured.err.startswith(DEMO_NOTICE)
    assert "prompt 5 tok, generated 16 tok" in captured.err


def test_chat_repl_keeps_history(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("deltaserve.llm")
    prompts: list[list[dict]] = []
    answers: list[str] = []
    chat_prompt, stream = cli._chat_prompt, cli.stream_completion

    def spy_prompt(tokenizer, messages, no_thinking):
        prompts.append([dict(m) for m in messages])
        return chat_prompt(tokenizer, messages, no_thinking)

    def spy_stream(*args, **kwargs):
        final, first = stream(*args, **kwargs)
        answers.append(final.outputs[0].text)
        return final, first

    monkeypatch.setattr(cli, "_chat_prompt", spy_prompt)
    monkeypatch.setattr(cli, "stream_completion", spy_stream)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n\n  Again  \n/exit\nnot read\n"))
    argv = ["chat", "--system", "Be brief.", "--max-tokens", "6", "--device", "cpu"]
    assert cli.main(argv) == 0

    system = {"role": "system", "content": "Be brief."}
    assert len(prompts) == 2 and len(answers) == 2
    assert prompts[0] == [system, {"role": "user", "content": "Hi"}]
    assert prompts[1] == [
        system,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": "Again"},
    ]
    assert capsys.readouterr().out == answers[0] + "\n" + answers[1] + "\n"


def test_cli_reports_bad_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("deltaserve.llm")
    assert cli.main(["generate", "Hi", "--model", str(tmp_path)]) == 1
    assert "deltaserve generate: error:" in capsys.readouterr().err


# --- vLLM's command shapes: positional model, --version, python -m deltaserve -----------------


def _run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltaserve", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("command", ["serve", "chat", "backends"])
def test_positional_model(command: str) -> None:
    parser = cli.build_parser()
    assert parser.parse_args([command, "models/tiny", "--device", "cpu"]).model == "models/tiny"
    assert parser.parse_args([command, "--device", "cpu", "models/tiny"]).model == "models/tiny"
    assert parser.parse_args([command, "--model", "m"]).model == "m"
    assert parser.parse_args([command, "m", "--model", "m"]).model == "m"
    assert parser.parse_args([command]).model is None


def test_generate_takes_model_then_prompt() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "models/tiny", "Hi there", "--max-tokens", "3"])
    assert (args.model, args.prompt) == ("models/tiny", "Hi there")
    args = parser.parse_args(["generate", "Hi there", "--model", "m"])
    assert (args.model, args.prompt) == ("m", "Hi there")


def test_model_given_twice_is_one_line_error() -> None:
    result = _run_cli("serve", "a", "--model", "b", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("error: model given twice: 'a' and 'b'")


def test_version_and_python_dash_m() -> None:
    from deltaserve import __version__

    result = _run_cli("--version", timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, f"deltaserve {__version__}")
    result = _run_cli("backends", "--help", timeout=60)
    assert result.returncode == 0 and "usage: deltaserve backends" in result.stdout


def test_top_level_help_claims_only_what_is_supported(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Qwen3 and Qwen3.5" in out
    assert "DeepSeek-V2 / V2-Lite (multi-head latent attention)" in out
    assert "planned" not in out


def test_backends_preview_on_a_pretend_gpu() -> None:
    result = _run_cli("backends", "--device", "cuda", "--compute-capability", "9.0")
    assert result.returncode == 0, result.stderr
    assert "device: cuda (pretend device, compute capability 9.0)" in result.stdout
    assert "no CUDA device" not in result.stdout
    old = _run_cli("backends", "--compute-capability", "7.5", "--attention-backend", "triton")
    assert old.returncode == 1
    assert old.stderr.strip().splitlines()[-1].startswith("deltaserve backends: error:")
    assert "compute capability 7.5 < 8.0" in old.stderr or "triton not installed" in old.stderr


def test_backends_rejects_a_malformed_compute_capability() -> None:
    result = _run_cli("backends", "--compute-capability", "nine", timeout=60)
    assert result.returncode == 2 and "'nine' is not MAJOR.MINOR" in result.stderr
