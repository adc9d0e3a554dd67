"""Chat image parts through the real server with the official openai client, on a tiny random
Qwen3.5 vision-language checkpoint (tests/multimodal/vl_models.py): base64, http and file://
images give HF's greedy tokens; each bad image is a 400 naming the part and the problem and the
server serves on; a hanging image fetch blocks no other request; a text-only model refuses
images before fetching them; /v1/completions takes no images."""

from __future__ import annotations

import base64
import re
import socket
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL, start_server
from image_server import IMAGE_PLACEHOLDER, VL_CHAT_TEMPLATE, image_server, png_bytes, png_of

from deltaserve.multimodal.media import MediaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))

from vl_models import (  # noqa: E402
    PROCESSOR,
    build_vl_model,
    float64_oracle,
    greedy_mismatch,
    hf_logprobs,
    image,
)

FETCH_TIMEOUT = 3.0
MAX_IMAGE_BYTES = 16384
MAX_IMAGE_PIXELS = 4096
MAX_IMAGES = 4  # limit_mm_per_prompt
NUM_NEW_TOKENS = 6


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def images():
    routes = {"/red.png": png_bytes(7, 5), "/b.png": png_of(image(21, 70, seed=2))}
    with image_server(routes) as srv:
        yield srv


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "c.png").write_bytes(png_of(image(45, 29, seed=3)))
    (root / "outside.png").write_bytes(png_bytes(2, 2))
    return root


@pytest.fixture(scope="module")
def vl(tmp_path_factory, media_dir):
    model_dir, oracle = build_vl_model("qwen3_5_vl", tmp_path_factory.mktemp("vl"))
    media = MediaConfig(
        allowed_local_media_path=str(media_dir / "allowed"),
        fetch_timeout=FETCH_TIMEOUT,
        max_image_bytes=MAX_IMAGE_BYTES,
        max_image_pixels=MAX_IMAGE_PIXELS,
    )
    running = start_server(
        model=str(model_dir),
        media=media,
        chat_template=VL_CHAT_TEMPLATE,
        max_model_len=256,
        limit_mm_per_prompt={"image": MAX_IMAGES},
        engine_process=True,  # images preprocessed by the server's front, pickled to the engine
    )
    running.oracle = float64_oracle(oracle)
    running.tokenizer = running.app.state.async_engine.engine.tokenizer
    yield running
    running.stop()


@pytest.fixture(scope="module")
def vclient(vl):
    with openai.OpenAI(base_url=f"{vl.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def _chat(client, content, **kwargs):
    kwargs = {"max_tokens": 2, "temperature": 0, **kwargs}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


def _expanded_ids(vl, rendered: str, images: list) -> list[int]:
    """The prompt ids with each placeholder expanded as HF's processor does."""
    grids = _processor()(images=images, return_tensors="pt")["image_grid_thw"]
    counts = iter(int(g.prod()) // PROCESSOR["merge_size"] ** 2 for g in grids)
    pad = vl.oracle.config.image_token_id
    ids: list[int] = []
    for t in vl.tokenizer.encode(rendered, add_special_tokens=False):
        ids += [t] * next(counts) if t == pad else [t]
    return ids


def _processor():
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(**PROCESSOR)


def test_image_chat_matches_hf(vl, vclient, images, media_dir):
    a = image(37, 53, seed=1)
    messages = [
        {"role": "system", "content": "t3"},
        {
            "role": "user",
            "content": [
                text_part("t5 t6"),
                image_part(data_url(png_of(a))),
                text_part("t7"),
                image_part(f"{images.url}/b.png"),
            ],
        },
        {"role": "assistant", "content": "t9"},
        {"role": "user", "content": [image_part(f"file://{media_dir}/allowed/c.png")]},
    ]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=NUM_NEW_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    resp = vclient.chat.completions.create(**kwargs)
    rendered = (
        "<|im_start|>system\nt3<|im_end|>\n"
        f"<|im_start|>user\nt5 t6{IMAGE_PLACEHOLDER}t7{IMAGE_PLACEHOLDER}<|im_end|>\n"
        "<|im_start|>assistant\nt9<|im_end|>\n"
        f"<|im_start|>user\n{IMAGE_PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    )
    images_in_order = [a, image(21, 70, seed=2), image(45, 29, seed=3)]
    ids = _expanded_ids(vl, rendered, images_in_order)
    tokens = [t.token for t in resp.choices[0].logprobs.content]
    generated = vl.tokenizer.convert_tokens_to_ids(tokens)
    assert len(generated) == NUM_NEW_TOKENS and tokens == [
        vl.tokenizer.decode([t]) for t in generated
    ]
    # HF's greedy continuation (teacher-forced: each token HF's argmax after the ones before)
    ref = hf_logprobs(vl.oracle, _processor(), ids + generated, images_in_order)
    assert greedy_mismatch(ref, len(ids), generated) is None
    assert resp.usage.prompt_tokens == len(ids)  # the image tokens count
    # streamed: the same text
    chunks = list(vclient.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        resp.choices[0].message.content
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bad_cases(images_url: str, media_dir) -> list[tuple[dict, str]]:
    big = png_bytes(40, 40, (1, 2, 3)) + b"\0" * MAX_IMAGE_BYTES
    return [
        (image_part(data_url(b"not an image at all")), "cannot be decoded"),
        (image_part("data:image/png;base64,@@@@"), "not valid base64"),
        (image_part(data_url(big)), f"too large: .* the limit is {MAX_IMAGE_BYTES} bytes"),
        (image_part(data_url(png_bytes(100, 50))), "100x50 = 5000 pixels"),
        (image_part(f"{images_url}/missing.png"), "HTTP 404"),
        (image_part(f"http://127.0.0.1:{_closed_port()}/a.png"), "unreachable"),
        (image_part(f"{images_url}/stall"), f"timed out after {FETCH_TIMEOUT:g} s"),
        (image_part(f"file://{media_dir}/outside.png"), "outside the allowed directory"),
        (image_part(f"file://{media_dir}/allowed/../outside.png"), "outside the allowed"),
        (image_part("ftp://127.0.0.1/a.png"), "unsupported image URL"),
        ({"type": "image_pil", "image_pil": "x"}, "offline API"),
        ({"type": "input_audio", "input_audio": {}}, "unsupported content part type"),
        ({"type": "image_url", "image_url": {"url": "u", "detail": "max"}}, "detail must be"),
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_images_are_400s_naming_the_problem(vl, vclient, images, media_dir, stream):
    for part, expected in bad_cases(images.url, media_dir):
        with pytest.raises(openai.BadRequestError) as info:
            _chat(vclient, [text_part("t1"), part], stream=stream)
        error = info.value.body
        assert info.value.status_code == 400
        assert error["param"] == "messages" and error["type"] == "invalid_request_error"
        assert error["message"].startswith("messages[0].content[1]: "), error["message"]
        assert re.search(expected, error["message"]), (expected, error["message"])
    # the server keeps serving, images included
    resp = _chat(vclient, [image_part(f"{images.url}/red.png"), text_part("t4")])
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_too_many_images_is_a_400(vl, vclient, images):
    parts = [image_part(f"{images.url}/red.png")] * (MAX_IMAGES + 1)
    with pytest.raises(openai.BadRequestError, match="exceed limit_mm_per_prompt image=4"):
        _chat(vclient, parts)


def test_fetch_does_not_block_other_requests(vl, vclient, images):
    """While one request's image fetch hangs, health checks and other chats are answered."""
    result: dict = {}

    def held_request() -> None:
        try:
            result["response"] = _chat(vclient, [image_part(f"{images.url}/hold")])
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=held_request)
    thread.start()
    try:
        assert images.held.wait(timeout=30), "the image server never got the fetch"
        assert httpx.get(f"{vl.url}/health", timeout=30).status_code == 200
        other = _chat(vclient, "t8 t9", extra_body={"ignore_eos": True})
        assert other.usage.completion_tokens == 2
        assert thread.is_alive() and not result, "the held request finished early"
    finally:
        images.release.set()
        thread.join(timeout=60)
    assert "error" not in result, result.get("error")
    assert result["response"].choices[0].finish_reason in ("length", "stop")


def test_tokenize_renders_unexpanded_placeholders(vl, images):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image_part("u")]}]}
    resp = httpx.post(f"{vl.url}/tokenize", json=body, headers=vl.headers, timeout=30)
    assert resp.status_code == 200, resp.text
    text = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    assert resp.json()["tokens"] == vl.tokenizer.encode(text, add_special_tokens=False)


def test_text_model_refuses_images_before_fetching(client, images):
    """The demo model has no vision tower: 400 saying so; the image is never fetched."""
    before = list(images.requests)
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, [text_part("hi"), image_part(f"{images.url}/red.png")])
    message = info.value.body["message"]
    assert message.startswith("this model takes no images: ") and "vision tower" in message
    assert images.requests == before
    assert _chat(client, "hello").choices[0].finish_reason in ("length", "stop")


def test_completions_refuse_images(server):
    body = {"model": MODEL, "prompt": "hi", "multi_modal_data": {"image": "x"}}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "multi_modal_data" and "/v1/chat/completions" in error["message"]
