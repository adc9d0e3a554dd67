"""Chat images through the server on a CUDA device (bf16 and float32, CUDA graphs and overlapped
decode on, as served): a base64 and an http image give the same greedy tokens as LLM.chat with
the same engine settings, and a bad image is still a 400. Run with `pytest -m gpu`."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import openai
import pytest
import torch
from conftest import API_KEY, MODEL, start_server
from image_server import VL_CHAT_TEMPLATE, image_server, png_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))

from vl_models import build_vl_model, image  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_NEW_TOKENS = 12
SETTINGS = dict(device="cuda", max_model_len=256, max_num_seqs=8, chat_template=VL_CHAT_TEMPLATE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_server_images_on_gpu_match_llm_chat(tmp_path, dtype):
    model_dir, _ = build_vl_model("qwen3_5_vl", tmp_path / "vl", load_oracle=False)
    a, b = image(37, 53, seed=1), image(45, 29, seed=3)
    with image_server({"/red.png": png_of(b)}) as srv:
        content = [
            {"type": "text", "text": "t5 t6"},
            {
                "type": "image_url",
                "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(png_of(a)).decode()
                },
            },
            {"type": "text", "text": "t7"},
            {"type": "image_url", "image_url": {"url": f"{srv.url}/red.png"}},
        ]
        messages = [{"role": "user", "content": content}]
        llm = LLM(str(model_dir), dtype=dtype, seed=0, **SETTINGS)
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        expected = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
        tokenizer = llm.get_tokenizer()
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()

        server = start_server(model=str(model_dir), dtype=dtype, **SETTINGS)
        try:
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
                resp = c.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=NUM_NEW_TOKENS,
                    temperature=0,
                    logprobs=True,
                    extra_body={"ignore_eos": True},
                )
                tokens = [t.token for t in resp.choices[0].logprobs.content]
                assert tokens == [tokenizer.decode([t]) for t in expected]
                bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
                with pytest.raises(openai.BadRequestError, match="cannot be decoded"):
                    c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": bad}], max_tokens=2
                    )
        finally:
            server.stop()
