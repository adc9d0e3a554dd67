"""Speculative decoding together with hybrid prefix caching (both on): a multi-turn
conversation whose second turn hits snapshots taken while the first turn was decoded with
verify rows (drafts crossing block edges, rejected ones rolled back) gives token for token the
output of plain decoding without a cache, and nothing leaks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parents[1]
for extra in (_TESTS_DIR, _TESTS_DIR / "spec"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import stub_proposers  # noqa: E402,F401  (registers the stub methods)
from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from test_spec_engine import HYBRID, K, assert_no_leak, greedy, make_llm  # noqa: E402

TURN1 = [5, 17, 3, 44, 9, 12, 31, 8, 21, 30, 2]
NEW_TURN = [40, 3, 19, 28, 11, 4]


@pytest.fixture(scope="module")
def turns(tmp_path_factory):
    """(model dir, [(prompt, plain greedy output)] for two turns), computed without
    speculation and without a prefix cache."""
    path, _ = build_model(SPECS_BY_NAME[HYBRID], tmp_path_factory.mktemp(HYBRID), load_oracle=False)
    plain = make_llm(path, enable_prefix_caching=False)
    out1 = list(plain.generate([{"prompt_token_ids": TURN1}], greedy(26))[0].outputs[0].token_ids)
    turn2 = TURN1 + out1 + NEW_TURN
    out2 = list(plain.generate([{"prompt_token_ids": turn2}], greedy(20))[0].outputs[0].token_ids)
    return path, [(TURN1, out1), (turn2, out2)]


@pytest.mark.parametrize(
    "method,extra", [("truncated_oracle", {"j": 2}), ("anti_oracle", {}), ("ngram", {})]
)
def test_second_turn_hits_and_equals_plain(turns, method, extra):
    path, conv = turns
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}  # fmt: skip
    else:
        spec = {"method": method, "num_speculative_tokens": K,
                "continuations": [(tuple(p), o) for p, o in conv], **extra}  # fmt: skip
    llm = make_llm(path, spec)  # prefix caching on by default
    engine = llm.llm_engine
    for i, (prompt, want) in enumerate(conv):
        before = engine.prefix_cache_stats()["prefix_cache_hit_tokens"]
        got = llm.generate([{"prompt_token_ids": prompt}], greedy(len(want)))[0]
        assert list(got.outputs[0].token_ids) == want, f"turn {i + 1}"
        if i == 1:  # the second turn reuses the first turn's prompt and answer
            hit = engine.prefix_cache_stats()["prefix_cache_hit_tokens"] - before
            assert hit >= len(TURN1), hit
    assert engine.spec.stats.num_verify_rows > 0
    assert_no_leak(llm)
