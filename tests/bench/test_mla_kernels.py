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
