"""`deltaserve bench vision` on CPU with the tiny random vision preset: every row runs and the
figures are consistent with the preset's image processor (Qwen3.5's: patch 16, merge 2)."""

from __future__ import annotations

import json

from deltaserve.cli import main


def test_bench_vision_rows(tmp_path):
    out = tmp_path / "vision.json"
    rc = main(
        ["bench", "vision", "--random-model", "tiny-qwen3.5-vl", "--device", "cpu", "--dtype",
         "float32", "--sizes", "256,320", "--images", "2", "--iters", "1", "--ttft-size", "288",
         "--text-tokens", "10", "--max-model-len", "1024", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["encoder"]
    assert [r["size"] for r in rows] == [256, 320]
    for r in rows:
        side = r["size"] // 16  # 256 and 320 are multiples of 32: no resizing
        assert r["patches_per_image"] == side * side
        assert r["tokens_per_image"] == side * side // 4
        assert r["encoder_images_per_s"] > 0 and r["preprocess_images_per_s"] > 0
    ttft = data["ttft"]
    assert ttft["prompt_tokens"] == 3 - 1 + (288 // 32) ** 2 + 10  # placeholder expanded
    assert ttft["ttft_image_s"] > 0 and ttft["ttft_text_same_tokens_s"] > 0
