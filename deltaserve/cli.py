"""The `deltaserve` command: generate | chat | backends | serve | smoke | bench.

Heavy imports (torch, the engine) happen inside the commands, so `deltaserve --help` stays fast.
New commands add a `_add_<name>_parser` function and a line in `build_parser`; `serve` and
`smoke` live in deltaserve/server/cli.py, `bench` in deltaserve/bench/, the engine's flags
(generated from `create_engine_config`'s keywords) in deltaserve/engine_flags.py.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import unicodedata
from collections.abc import Sequence
from typing import Any, TextIO

from deltaserve import __version__
from deltaserve.engine_flags import (  # noqa: F401 - re-exported for the commands' parsers
    BACKEND_FLAGS,
    add_async_arg,
    add_backend_args,
    add_engine_args,
    add_engine_flag,
    add_model_arg,
    backend_kwargs,
    engine_kwargs,
)

_request_ids = itertools.count()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the chosen command, return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as e:  # bad model, prompt or option: no traceback
        print(f"deltaserve {args.command}: error: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subparser per command, each with a `handler` default."""
    parser = argparse.ArgumentParser(
        prog="deltaserve",
        description="LLM inference engine with vLLM's offline API and an OpenAI-compatible "
        "server. Supported today: Qwen3 and Qwen3.5 models, dense and MoE, Qwen3-Next "
        "(hybrid Gated DeltaNet + attention layers) and DeepSeek-V2 / V2-Lite (multi-head "
        "latent attention). Without a model, "
        "commands run the embedded demo model (tiny, random weights).",
    )
    parser.add_argument("--version", action="version", version=f"deltaserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate_parser(commands)
    _add_chat_parser(commands)
    _add_backends_parser(commands)
    from deltaserve.server.cli import add_serve_parser, add_smoke_parser

    add_serve_parser(commands)
    add_smoke_parser(commands)
    from deltaserve.bench import add_bench_parser

    add_bench_parser(commands)
    return parser


# --- shared options (the engine's flags live in deltaserve/engine_flags.py) ---------------------


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """Options that build the `SamplingParams` of each request (its seed is the engine's
    `--seed`)."""
    parser.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N")
    parser.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)"
    )
    parser.add_argument("--top-p", type=float, default=None, metavar="P")
    parser.add_argument("--top-k", type=int, default=None, metavar="K")
    parser.add_argument(
        "--no-thinking",
        action="store_true",
        help="with the chat template: pass enable_thinking=False (empty think block)",
    )


# --- commands -----------------------------------------------------------------------------------


def _add_generate_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "generate",
        help="complete one prompt, streaming the text to stdout",
        description="Complete PROMPT and stream the generated text to stdout; a stats line "
        "goes to stderr. One positional is the prompt; with two, the first is the model "
        "(`deltaserve generate MODEL PROMPT`, written together, before any option), as with "
        "--model.",
    )
    add_model_arg(parser)
    parser.add_argument("prompt", metavar="PROMPT", help='the prompt text ("-" reads stdin)')
    parser.add_argument(
        "--chat", action="store_true", help="wrap PROMPT as a user message in the chat template"
    )
    add_engine_args(parser, model_arg=False)
    add_sampling_args(parser, max_tokens=64)
    parser.set_defaults(handler=_run_generate)


def _add_chat_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "chat",
        help="interactive chat: one user message per line, until EOF or /exit",
        description="Read user messages from stdin, one per line (EOF or /exit ends), keep the "
        "conversation and stream each answer through the model's chat template. On a terminal, "
        "lines can be edited and recalled (readline). A message that would make the "
        "conversation longer than max-model-len is reported and dropped; the session goes on.",
    )
    parser.add_argument("--system", default=None, help="system message for the conversation")
    add_engine_args(parser)
    add_sampling_args(parser, max_tokens=256)
    parser.set_defaults(handler=_run_chat)


def _add_backends_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "backends",
        help="print the kernel backend chosen for each layer type and op, with reasons",
        description="Print the kernel backend chosen for each op family, with the reasons the "
        "faster ones were passed over, without loading weights.",
    )
    add_model_arg(parser)
    add_engine_flag(parser, "device")
    add_engine_flag(parser, "dtype")
    parser.add_argument(
        "--compute-capability",
        type=_compute_capability,
        default=None,
        metavar="X.Y",
        help="preview the choice on a pretend CUDA device of this compute capability (e.g. 9.0 "
        "for H100), without a GPU; implies --device cuda",
    )
    add_backend_args(parser)
    parser.set_defaults(handler=_run_backends)


def _run_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    llm = _build_llm(args)
    if args.chat:
        messages = [{"role": "user", "content": prompt}]
        prompt = _chat_prompt(llm.get_tokenizer(), messages, args.no_thinking)
    start = time.perf_counter()
    output, first_token_s = stream_completion(llm, prompt, _sampling_params(args), sys.stdout)
    elapsed = time.perf_counter() - start
    _print_stats(output, elapsed, first_token_s)
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    tokenizer = llm.get_tokenizer()
    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 - gives input() line editing and history on a terminal

        print("Type a message and press Enter; /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": text})
        try:
            prompt = _chat_prompt(tokenizer, messages, args.no_thinking)
            output, _ = stream_completion(llm, prompt, params, sys.stdout)
        except KeyboardInterrupt:  # stop this answer, keep the session
            print(file=sys.stdout, flush=True)
            messages.pop()
            continue
        except ValueError as e:  # e.g. longer than max_model_len: drop the turn, keep the rest
            print(
                f"deltaserve chat: error: {e} (message dropped; the conversation so far is kept)",
                file=sys.stderr,
                flush=True,
            )
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": output.outputs[0].text})
    if interactive:
        print(file=sys.stderr)
    return 0


def _run_backends(args: argparse.Namespace) -> int:
    from deltaserve.backends import OP_FAMILIES, format_backend_table

    forced = {op: getattr(args, family.keyword) for op, family in OP_FAMILIES.items()}
    model, cc = _resolve_model(args), args.compute_capability
    if cc is None:
        print(format_backend_table(model, args.device, args.dtype, forced, args.state_dtype))
        return 0
    if args.device == "cpu":
        raise ValueError("--compute-capability previews a CUDA device: drop --device cpu")
    table = format_backend_table(
        model, "cuda", args.dtype, forced, args.state_dtype, compute_capability=cc
    )
    print(table)
    return 0


def _compute_capability(text: str) -> tuple[int, int]:
    """ "9.0" -> (9, 0) (argparse type of --compute-capability)."""
    major, dot, minor = text.partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not MAJOR.MINOR, e.g. 9.0")
    return int(major), int(minor)


# --- helpers ------------------------------------------------------------------------------------


def _resolve_model(args: argparse.Namespace) -> str:
    """`--model`, or the demo model (after telling the user, on stderr, what it is)."""
    if args.model is not None:
        return args.model
    from deltaserve.loader.demo import DEMO_NOTICE, ensure_demo_model

    print(DEMO_NOTICE, file=sys.stderr, flush=True)
    return str(ensure_demo_model())


def _build_llm(args: argparse.Namespace):
    from deltaserve.llm import LLM

    return LLM(_resolve_model(args), **engine_kwargs(args))


def _sampling_params(args: argparse.Namespace):
    from deltaserve.sampling_params import SamplingParams

    optional = {"top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    kwargs = {key: value for key, value in optional.items() if value is not None}
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, **kwargs)


def _chat_prompt(tokenizer: Any, messages: list[dict[str, str]], no_thinking: bool) -> dict:
    """The prompt for `messages` (text and token ids), ending with the assistant generation
    prompt, rendered exactly as `LLM.chat` renders it."""
    from deltaserve.loader.tokenizer import apply_chat_template

    kwargs = {"enable_thinking": False} if no_thinking else None
    text, token_ids = apply_chat_template(tokenizer, messages, True, kwargs)
    return {"prompt": text, "prompt_token_ids": token_ids}


def stream_completion(
    llm: Any, prompt: str | dict, params: Any, out: TextIO
) -> tuple[Any, float | None]:
    """Run one request on `llm`'s engine, writing each new piece of its text to `out` as it is
    generated, then a newline. Returns the final RequestOutput and the seconds until the first
    generated token (None if there was none). Ctrl-C aborts the request and re-raises."""
    engine = llm.llm_engine
    request_id = f"cli-{next(_request_ids)}"
    to_terminal = out.isatty()
    start = time.perf_counter()
    first_token_s: float | None = None
    final = None
    shown = ""
    engine.add_request(request_id, prompt, params)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                final = output
                completion = output.outputs[0]
                if first_token_s is None and completion.token_ids:
                    first_token_s = time.perf_counter() - start
                # NOTE: the engine's text only grows; the delta is what this step added.
                delta = completion.text[len(shown) :]
                shown = completion.text
                if delta:
                    out.write(_printable(delta) if to_terminal else delta)
                    out.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    out.write("\n")
    out.flush()
    if final is None or not final.finished:
        raise RuntimeError(f"engine finished without a final output for request {request_id}")
    return final, first_token_s


def _printable(text: str) -> str:
    """Escape control characters other than newline and tab, so that model output cannot send
    terminal control sequences."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch in "\n\t" or unicodedata.category(ch) != "Cc" else f"\\x{ord(ch):02x}"
        for ch in text
    )


def _print_stats(output: Any, elapsed: float, first_token_s: float | None) -> None:
    completion = output.outputs[0]
    generated = len(completion.token_ids)
    rate = generated / elapsed if elapsed > 0 else float("inf")
    first = f", first token {first_token_s:.2f} s" if first_token_s is not None else ""
    print(
        f"[deltaserve] prompt {len(output.prompt_token_ids)} tok, generated {generated} tok "
        f"in {elapsed:.2f} s ({rate:.1f} tok/s{first}), finish={completion.finish_reason}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
