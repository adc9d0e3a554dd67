"""`deltaserve bench spec` on CPU with the tiny random preset: every row runs, forced acceptance
makes each verify step emit exactly tau tokens per sequence, plain decode emits one."""

from __future__ import annotations

import json

from deltaserve.cli import main


def test_bench_spec_forces_tau_tokens_per_step(tmp_path):
    out = tmp_path / "spec.json"
    rc = main(
        ["bench", "spec", "--random-model", "tiny-qwen3.5", "--device", "cpu", "--dtype",
         "float32", "--batches", "1,2", "--taus", "1,3,4", "--num-speculative-tokens", "3",
         "--context", "16", "--steps", "3", "--warmup-steps", "1", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 4
    for r in rows:
        want = r["tau"] if r["speculative"] else 1
        assert r["tokens_per_step"] == want, r
        assert r["tok_s"] > 0 and r["proposer_ms"] >= 0


def test_bench_spec_times_dflash_in_graphs(tmp_path, monkeypatch):
    """A random DFlash drafter on synthetic contexts (the drafter takes them as observed),
    the decode-graph path emulated on CPU: every timed target step (verify steps with the
    drafter's taps, plain decode steps) and every block forward replays a graph, and the
    report says so."""
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    out = tmp_path / "spec.json"
    steps = 3
    rc = main(
        ["bench", "spec", "--random-model", "tiny-qwen3.5", "--device", "cpu", "--dtype",
         "float32", "--batches", "2", "--taus", "1,4", "--num-speculative-tokens", "3",
         "--context", "16", "--steps", str(steps), "--warmup-steps", "1", "--proposer",
         "dflash", "--proposer-options", '{"model": "random:tiny-dflash"}', "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3
    for r in rows:
        assert r["tokens_per_step"] == (r["tau"] if r["speculative"] else 1), r
        assert r["graph_steps"] == steps, r
        assert r["drafter_graph_steps"] == (steps if r["speculative"] else 0), r


def test_bench_spec_times_mtp_in_verify_graphs(tmp_path, monkeypatch):
    """The random preset's own random MTP head (`--proposer mtp`) on synthetic contexts, the
    decode-graph path emulated: every timed target step replays a graph (verify steps keeping
    the final-hidden tap the head reads), so does every chain of the head, and forced
    acceptance emits tau tokens per step."""
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    out = tmp_path / "spec.json"
    steps = 3
    rc = main(
        ["bench", "spec", "--random-model", "tiny-qwen3.5", "--device", "cpu", "--dtype",
         "float32", "--batches", "2", "--taus", "1,3", "--num-speculative-tokens", "2",
         "--context", "16", "--steps", str(steps), "--warmup-steps", "1", "--proposer", "mtp",
         "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3
    for r in rows:
        assert r["tokens_per_step"] == (r["tau"] if r["speculative"] else 1), r
        assert r["graph_steps"] == steps, r
        assert r["drafter_graph_steps"] == (steps if r["speculative"] else 0), r  # the chain


def test_bench_spec_on_cpu_defaults_to_the_tiny_preset(monkeypatch, capsys):
    """Without --random-model on CPU the bench takes the tiny preset and says so (the 9B's
    float32 weights alone would take 36 GB); a preset too large for the machine's memory is
    refused in one line before anything is built."""
    from deltaserve.bench import memory

    rc = main(
        ["bench", "spec", "--device", "cpu", "--dtype", "float32", "--batches", "1", "--taus",
         "2", "--num-speculative-tokens", "2", "--context", "16", "--steps", "2",
         "--warmup-steps", "1"]
    )  # fmt: skip
    assert rc == 0
    assert "bench spec on CPU: --random-model tiny-qwen3.5" in capsys.readouterr().err
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 20)
    assert main(["bench", "spec", "--random-model", "qwen3.5-9b", "--device", "cpu"]) == 1
    assert "random model qwen3.5-9b does not fit in memory" in capsys.readouterr().err
