"""`deltaserve bench throughput --tensor-parallel-size 2` on CPU (gloo): the decode rows carry
the all-reduces of one step (count from the engine's own forwards: the embedding's, then two
per decoder layer) and the control message's cost, measured with every rank taking part."""

from __future__ import annotations

import gc
import json

from hf_models import SPECS_BY_NAME, build_model

from deltaserve.cli import main
from deltaserve.distributed.parallel_state import tp_size


def test_bench_reports_comm_costs_under_tp(tmp_path, capsys) -> None:
    spec = SPECS_BY_NAME["qwen3_5_r2_g3"]
    model_dir, _ = build_model(spec, tmp_path / "m", load_oracle=False)
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", "--device", "cpu", "--dtype", "float32", "--model",
            str(model_dir), "--prefill-lens", "8", "--decode-batches", "2,3", "--contexts", "8",
            "--decode-steps", "2", "--warmup-steps", "1", "--repeats", "1", "--copy-bw", "1e10",
            "--matmul-flops", "1e11", "--tensor-parallel-size", "2",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    gc.collect()
    assert tp_size() == 1  # the bench's engine stopped its worker
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["tensor_parallel_size"] == 2
    decode = [r for r in result["rows"] if r["kind"] == "decode"]
    assert [r["batch"] for r in decode] == [2, 3]
    layers = spec.config["num_hidden_layers"]
    for row in decode:
        assert row["all_reduces_per_step"] == 1 + 2 * layers
        assert row["allreduce_us_per_step"] > 0 and row["control_us_per_step"] > 0
        assert row["allreduce_pct_of_step"] > 0
    assert "us/step" in text and "control message" in text
