"""`deltaserve bench kernels --only mla` on CPU: the timed calls compute the reference's
result at tiny shapes (Triton in its interpreter), and the table shows each row's floor."""

from __future__ import annotations

import pytest
import torch

from deltaserve.bench.kernels import add_floors, format_tables, kernel_row


def test_timed_triton_call_matches_the_timed_reference_call() -> None:
    pytest.importorskip("triton")
    from deltaserve.bench.mla_kernels import make_mla_inputs, mla_step

    x = make_mla_inputs(2, 37, 3, r=20, p=6, page=8, dtype=torch.float32, device="cpu")
    ours = mla_step("triton", x, 0.3, {"NUM_SPLITS": 1})()
    want = mla_step("torch", x, 0.3)()
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown MLA impl"):
        mla_step("nope", x, 0.3)


def test_mla_table_has_latent_bytes_floor_and_config() -> None:
    from deltaserve.bench.mla_kernels import latent_bytes

    nbytes = latent_bytes(64, 4096)
    assert nbytes == 64 * 4096 * 576 * 2
    rows = [
        {
            **kernel_row("mla", "triton", nbytes, 100.0, batch=64, context=4096, heads=16),
            "config": "",
        },
        {
            **kernel_row("mla", "triton-variant", nbytes, 200.0, batch=64, context=4096, heads=16),
            "config": "NUM_SPLITS=2",
        },
    ]
    add_floors(rows, copy_bw=nbytes / 50e-6)  # floor 50 us
    table = format_tables(rows)
    assert "Absorbed MLA decode" in table
    assert "| 16 | 64 | 4096 | triton | 100.0 | 3.02 | 50.0 | 50 | 1.00 |  |" in table
    assert (
        "| 16 | 64 | 4096 | triton-variant | 200.0 | 1.51 | 50.0 | 25 | 2.00 | NUM_SPLITS=2 |"
        in (table)
    )


def test_mla_variants_and_heads_from_the_command_line(monkeypatch) -> None:
    """--mla-variants / --mla-heads reach bench_mla_rows; a malformed list is refused by name."""
    import argparse

    from deltaserve.bench import kernels, mla_kernels

    parser = argparse.ArgumentParser()
    kernels.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["kernels", "--only", "mla", "--quick", "--mla-heads", "16",
         "--mla-variants", '[{"NUM_SPLITS": 6}, {"BLOCK_N": 32, "num_stages": 3}]']
    )  # fmt: skip
    assert args.mla_heads == [16]
    assert args.mla_variants == [{"NUM_SPLITS": 6}, {"BLOCK_N": 32, "num_stages": 3}]
    for bad in ("[{}]", '{"NUM_SPLITS": 6}', "[NUM_SPLITS=6]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["kernels", "--mla-variants", bad])
    # the rows: the default, then each variant, per head count asked for (no FlashInfer, no
    # GPU: the timed step is replaced, the configurations it was given are recorded)
    seen = []

    def fake_step(impl, x, scale, config=None):  # noqa: ANN001, ANN202
        seen.append((impl, x["q_lat"].shape[1], config))
        return lambda: None

    monkeypatch.setattr(mla_kernels, "mla_step", fake_step)
    monkeypatch.setattr(mla_kernels, "make_mla_inputs", lambda b, c, h: {
        "q_lat": torch.zeros(b, h, 1)})  # fmt: skip
    monkeypatch.setattr("deltaserve.backend_checks.package_installed", lambda name: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, rep: 0.01)
    errors: list[str] = []
    rows = mla_kernels.bench_mla_rows([(64, 4096)], errors, args.mla_variants, args.mla_heads)
    triton_runs = [(h, c) for impl, h, c in seen if impl == "triton"]
    assert triton_runs == [(16, None), (16, {"NUM_SPLITS": 6}),
                           (16, {"BLOCK_N": 32, "num_stages": 3})]  # fmt: skip
    assert [r["config"] for r in rows] == ["", "NUM_SPLITS=6", "BLOCK_N=32 num_stages=3"]
    assert all(r["us"] == 10.0 for r in rows)
    assert errors == ["mla: flashinfer not installed, its rows are skipped"]
