"""min_tokens bans every token that would end a sequence early: its EOS ids and its
stop_token_ids (engine/llm_engine.py, `_banned`).

Most engine tests set `ignore_eos`, so nothing else notices when EOS drops out of the banned
set. Here the checkpoint's EOS id is the very token greedy decoding emits first: without
min_tokens the request stops at once; with min_tokens=k it must run at least k tokens and
emit no EOS among them. The same for a stop_token_ids entry (EOS ignored). Both with overlapped
decode off and on (the bans must hold for tokens still on the device).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import build_model  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

PROMPT = [5, 17, 33, 8, 21, 2, 40]
MIN_TOKENS = 5
MAX_TOKENS = 12


def _llm(model_dir: Path, async_on: bool) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
        async_scheduling=async_on,
    )


def _greedy(llm: LLM, **params) -> tuple[list[int], str | None, int | str | None]:
    """(token ids, finish_reason, stop_reason) of PROMPT under greedy decoding."""
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
    c = out.outputs[0]
    return list(c.token_ids), c.finish_reason, c.stop_reason


@pytest.fixture(scope="module")
def eos_first(tmp_path_factory) -> tuple[Path, int]:
    """A hybrid (GDN + attention) checkpoint whose EOS id, in config.json and
    generation_config.json, is the first token greedy decoding emits for PROMPT."""
    model_dir, _ = build_model("qwen3_5_r2_g3", tmp_path_factory.mktemp("eos"), load_oracle=False)
    first = _greedy(_llm(model_dir, False), ignore_eos=True)[0][0]
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        cfg["eos_token_id"] = first
        if "text_config" in cfg:
            cfg["text_config"]["eos_token_id"] = first
        path.write_text(json.dumps(cfg))
    return model_dir, first


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlapped"])
def llm(request, eos_first) -> LLM:
    return _llm(eos_first[0], request.param)


def test_eos_ends_at_once_without_min_tokens(llm, eos_first) -> None:
    _, eos = eos_first
    assert llm.llm_engine.eos_token_ids == {eos}
    assert _greedy(llm) == ([eos], "stop", None)


def test_min_tokens_bans_eos_until_reached(llm, eos_first) -> None:
    _, eos = eos_first
    tokens, finish, _ = _greedy(llm, min_tokens=MIN_TOKENS)
    assert len(tokens) >= MIN_TOKENS
    assert eos not in tokens[:MIN_TOKENS], tokens
    # after min_tokens, EOS ends it again (if greedy decoding picks it before max_tokens)
    if finish == "stop":
        assert tokens[-1] == eos and eos not in tokens[:-1]
    else:
        assert finish == "length" and len(tokens) == MAX_TOKENS and eos not in tokens


def test_stop_token_ids_end_at_once_without_min_tokens(llm, eos_first) -> None:
    _, first = eos_first
    assert _greedy(llm, ignore_eos=True, stop_token_ids=[first]) == ([first], "stop", first)


def test_min_tokens_bans_stop_token_ids_until_reached(llm, eos_first) -> None:
    _, first = eos_first
    tokens, finish, reason = _greedy(
        llm, ignore_eos=True, stop_token_ids=[first], min_tokens=MIN_TOKENS
    )
    assert len(tokens) >= MIN_TOKENS
    assert first not in tokens[:MIN_TOKENS], tokens
    if finish == "stop":
        assert tokens[-1] == first and reason == first
    else:
        assert finish == "length" and len(tokens) == MAX_TOKENS


def test_ignore_eos_without_min_tokens_runs_to_max_tokens(llm, eos_first) -> None:
    """The control: the same request with EOS ignored does not stop at its first token."""
    _, eos = eos_first
    tokens, finish, _ = _greedy(llm, ignore_eos=True)
    assert tokens[0] == eos and len(tokens) == MAX_TOKENS and finish == "length"
