"""`deltaserve bench vision`: the vision encoder's images/s and the TTFT of an image prompt.

On a random-weight vision preset (default `qwen3.5-9b-vl`: the 9B text model plus the released
vision tower's shape, deltaserve/loader/random_model.py):

- encoder throughput: for each `--sizes` S (square S x S images), `--images` distinct random
  images preprocessed once (the checkpoint's image processor, host; its rate is reported
  apart), then the vision tower over all of them in one call, `--iters` times: images/s of the
  tower alone (device time, synchronised);
- TTFT: one fresh `--ttft-size` image plus `--text-tokens` random text tokens, max_tokens 1,
  prefix caching off, a new image each time (no encoder cache hit): the median time from
  `generate` to its output (preprocessing, encoder, prefill and the first token), beside a
  text-only prompt of the same token count.

Output: a markdown table, and `--json PATH`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from deltaserve.bench.throughput import _int_list

# the defaults on a GPU, and on CPU (where the 9B-VL preset's float32 weights alone take 36 GB
# and its 1024-pixel images run for minutes): tiny preset, small images
GPU_DEFAULTS = dict(
    random_model="qwen3.5-9b-vl", sizes=[448, 1024], images=8, iters=5, ttft_size=1024,
    text_tokens=100, max_model_len=8192,
)  # fmt: skip
CPU_DEFAULTS = dict(
    random_model="tiny-qwen3.5-vl", sizes=[256, 320], images=2, iters=1, ttft_size=288,
    text_tokens=10, max_model_len=1024,
)  # fmt: skip


def _text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def fill_defaults(args: argparse.Namespace) -> None:
    """The options left unset, from GPU_DEFAULTS or (on CPU) CPU_DEFAULTS, the CPU ones named
    on stderr."""
    from deltaserve.config import resolve_device

    cpu = resolve_device(args.device).type != "cuda"
    table = CPU_DEFAULTS if cpu else GPU_DEFAULTS
    filled = []
    for dest, value in table.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
            filled.append(f"--{dest.replace('_', '-')} {_text(value)}")
    if cpu and filled:
        print("bench vision on CPU: " + " ".join(filled), file=sys.stderr)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("vision", help="vision encoder images/s and TTFT of an image prompt")
    gpu, cpu = GPU_DEFAULTS, CPU_DEFAULTS
    p.add_argument(
        "--random-model",
        default=None,
        help=f"random-weight vision preset (default {gpu['random_model']} on a GPU, "
        f"{cpu['random_model']} on CPU)",
    )
    for flag, kind, metavar, what in (
        ("--sizes", _int_list, "S,..", "image sides"),
        ("--images", int, "N", "images per encoder call"),
        ("--iters", int, "N", "timed encoder calls / TTFT requests"),
        ("--ttft-size", int, "S", "the TTFT prompt's image side"),
        ("--text-tokens", int, "N", "the TTFT prompt's text tokens"),
        ("--max-model-len", int, "N", "the engine's max_model_len"),
    ):
        dest = flag.removeprefix("--").replace("-", "_")
        p.add_argument(
            flag,
            type=kind,
            default=None,
            metavar=metavar,
            help=f"{what} (default {_text(gpu[dest])} on a GPU, {_text(cpu[dest])} on CPU)",
        )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.set_defaults(handler=run)


def _images(n: int, size: int, seed: int) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8")) for _ in range(n)]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encoder_rows(llm, sizes: list[int], n: int, iters: int, seed: int) -> list[dict]:
    """Per size: preprocessing and tower images/s, merged tokens per image."""
    import torch

    engine = llm.llm_engine
    proc = engine.image_processor.image_processor
    inst = engine.runner.instance
    rows = []
    for size in sizes:
        images = _images(n, size, seed + size)
        t0 = time.perf_counter()
        out = proc(images=images, return_tensors="pt")
        pre_s = time.perf_counter() - t0
        pixels = out["pixel_values"].to(torch.float32)
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        with torch.inference_mode():
            inst.encode_images(pixels, grids)  # warm-up
            _sync(inst.device)
            t0 = time.perf_counter()
            for _ in range(iters):
                embeds = inst.encode_images(pixels, grids)
            _sync(inst.device)
            dt = time.perf_counter() - t0
        rows.append(
            {
                "size": size,
                "tokens_per_image": embeds[0].shape[0],
                "patches_per_image": grids[0][0] * grids[0][1] * grids[0][2],
                "encoder_images_per_s": n * iters / dt,
                "preprocess_images_per_s": n / pre_s,
            }
        )
    return rows


def ttft(llm, size: int, text_tokens: int, iters: int, seed: int) -> dict:
    """Median TTFT (s) of one size x size image + text_tokens random tokens, and of a text-only
    prompt of the same token count."""
    import torch

    from deltaserve import SamplingParams

    engine = llm.llm_engine
    hf = engine.config.model.hf_config
    vocab = int(engine.config.model.text_config.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    image_times, text_times, prompt_len = [], [], 0
    for i in range(iters + 1):  # the first of each is a warm-up
        text = torch.randint(0, min(vocab, hf.vision_start_token_id), (text_tokens,), generator=gen)
        ids = [hf.vision_start_token_id, hf.image_token_id, hf.vision_end_token_id]
        prompt = {
            "prompt_token_ids": ids + text.tolist(),
            "multi_modal_data": {"image": _images(1, size, seed + 1000 + i)[0]},
        }
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        t_image = time.perf_counter() - t0
        prompt_len = len(out.prompt_token_ids)
        plain = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": plain}], params, use_tqdm=False)
        t_text = time.perf_counter() - t0
        if i:
            image_times.append(t_image)
            text_times.append(t_text)
    return {
        "size": size,
        "prompt_tokens": prompt_len,
        "ttft_image_s": statistics.median(image_times),
        "ttft_text_same_tokens_s": statistics.median(text_times),
    }


def run(args: argparse.Namespace) -> int:
    from deltaserve import LLM
    from deltaserve.bench.memory import check_random_model_fits

    fill_defaults(args)
    check_random_model_fits(args.random_model, args.dtype, args.device)

    llm = LLM(
        random_model=args.random_model,
        max_model_len=args.max_model_len,
        max_num_seqs=4,
        enable_prefix_caching=False,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    if llm.llm_engine.image_processor is None:
        raise SystemExit(f"{args.random_model} takes no images (use a vision preset, e.g. -vl)")
    rows = encoder_rows(llm, args.sizes, args.images, args.iters, args.seed)
    first = ttft(llm, args.ttft_size, args.text_tokens, args.iters, args.seed)
    device = llm.llm_engine.config.model.device
    print(f"## vision encoder, random:{args.random_model} on {device}\n")
    print("| image | patches | tokens | encoder images/s | preprocess images/s (host) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['size']}x{r['size']} | {r['patches_per_image']} | {r['tokens_per_image']} | "
            f"{r['encoder_images_per_s']:.1f} | {r['preprocess_images_per_s']:.1f} |"
        )
    print(
        f"\nTTFT, one {first['size']}x{first['size']} image + {args.text_tokens} text tokens "
        f"({first['prompt_tokens']} prompt tokens): {first['ttft_image_s'] * 1e3:.1f} ms "
        f"(text-only prompt of the same length: {first['ttft_text_same_tokens_s'] * 1e3:.1f} ms)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.random_model, "encoder": rows, "ttft": first}, f, indent=1)
    return 0
