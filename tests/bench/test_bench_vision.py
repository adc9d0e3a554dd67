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


def test_bench_vision_on_cpu_takes_small_defaults(capsys):
    """With no options on CPU the bench runs the tiny vision preset on small images, and says
    so on stderr (the GPU's defaults, the 9B-VL preset in float32 and 1024-pixel images, took
    more memory than a CI machine has and were killed); named options are kept."""
    import argparse

    from deltaserve.bench import vision

    assert main(["bench", "vision", "--device", "cpu", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert "bench vision on CPU: --random-model tiny-qwen3.5-vl --sizes 256,320" in err
    args = argparse.Namespace(
        device="cpu", random_model=None, sizes=[64], images=None, iters=None, ttft_size=None,
        text_tokens=None, max_model_len=None,
    )  # fmt: skip
    vision.fill_defaults(args)
    assert args.sizes == [64] and args.random_model == "tiny-qwen3.5-vl"
    assert args.max_model_len == vision.CPU_DEFAULTS["max_model_len"]
