"""Chat image parts through the real server with the official openai client: base64 images,
URLs from a local image server, file:// under --allowed-local-media-path; each bad image a 400
naming the part and the problem, and the server serving on; image fetches off the event loop.

The demo model has no vision tower: these tests check the server up to the engine call (what
the engine receives), with a chat template that renders image parts as Qwen3.5's does."""

from __future__ import annotations

import base64
import socket
import threading

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL, start_server
from image_server import image_server, png_bytes

from deltaserve.multimodal.media import MediaConfig

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}" + PAD + "{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FETCH_TIMEOUT = 3.0
MAX_IMAGE_BYTES = 8192
MAX_IMAGE_PIXELS = 4096


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def images():
    with image_server({"/red.png": png_bytes(7, 5), "/blue.png": png_bytes(3, 4)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "green.png").write_bytes(png_bytes(2, 6))
    (root / "outside.png").write_bytes(png_bytes(2, 2))
    return root


@pytest.fixture(scope="module")
def image_server_app(deltaserve_cache_dir, media_dir):
    media = MediaConfig(
        allowed_local_media_path=str(media_dir / "allowed"),
        fetch_timeout=FETCH_TIMEOUT,
        max_image_bytes=MAX_IMAGE_BYTES,
        max_image_pixels=MAX_IMAGE_PIXELS,
    )
    running = start_server(media=media, chat_template=TEMPLATE)
    engine = running.app.state.async_engine.engine
    seen: list[dict] = []
    add_request = engine.add_request

    def recording_add_request(request_id, prompt, params=None):
        seen.append(prompt)
        return add_request(request_id, prompt, params)

    engine.add_request = recording_add_request
    running.seen = seen
    yield running
    running.stop()


@pytest.fixture(scope="module")
def vclient(image_server_app):
    with openai.OpenAI(
        base_url=f"{image_server_app.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
    ) as c:
        yield c


def _chat(client, content, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=2,
        temperature=0,
        **kwargs,
    )


def test_images_reach_the_engine_in_order(image_server_app, vclient, images, media_dir):
    image_server_app.seen.clear()
    file_url = f"file://{media_dir}/allowed/green.png"
    messages = [
        {"role": "system", "content": "describe"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first:"},
                image_part(data_url(png_bytes(9, 2))),
                image_part(f"{images.url}/red.png"),
                {"type": "text", "text": "then"},
            ],
        },
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [image_part(file_url), image_part(f"{images.url}/blue.png")]},
    ]
    resp = vclient.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0
    )
    assert resp.choices[0].finish_reason in ("length", "stop")
    (prompt,) = image_server_app.seen
    sizes = [im.size for im in prompt["multi_modal_data"]["image"]]
    assert sizes == [(9, 2), (7, 5), (2, 6), (3, 4)]
    assert all(im.mode == "RGB" for im in prompt["multi_modal_data"]["image"])
    assert prompt["prompt"] == (
        "<|im_start|>system\ndescribe<|im_end|>\n"
        f"<|im_start|>user\nfirst:{PAD}{PAD}then<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
        f"<|im_start|>user\n{PAD}{PAD}<|im_end|>\n<|im_start|>assistant\n"
    )
    tokenizer = image_server_app.app.state.async_engine.engine.tokenizer
    assert prompt["prompt_token_ids"] == tokenizer.encode(
        prompt["prompt"], add_special_tokens=False
    )


def test_text_only_parts_send_no_images(image_server_app, vclient):
    image_server_app.seen.clear()
    _chat(vclient, [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    (prompt,) = image_server_app.seen
    assert "multi_modal_data" not in prompt
    assert prompt["prompt"] == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"


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
def test_bad_images_are_400s_naming_the_problem(
    image_server_app, vclient, images, media_dir, stream
):
    import re

    for part, expected in bad_cases(images.url, media_dir):
        content = [{"type": "text", "text": "look"}, part]
        with pytest.raises(openai.BadRequestError) as info:
            _chat(vclient, content, stream=stream)
        error = info.value.body
        assert info.value.status_code == 400
        assert error["param"] == "messages" and error["type"] == "invalid_request_error"
        assert error["message"].startswith("messages[0].content[1]: "), error["message"]
        assert re.search(expected, error["message"]), (expected, error["message"])
    # the server keeps serving, images included
    resp = _chat(vclient, [image_part(f"{images.url}/red.png"), {"type": "text", "text": "hi"}])
    assert resp.choices[0].message.content is not None


def test_fetch_does_not_block_other_requests(image_server_app, vclient, images):
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
        health = httpx.get(f"{image_server_app.url}/health", timeout=30)
        assert health.status_code == 200
        other = _chat(vclient, "hello", extra_body={"ignore_eos": True})
        assert other.usage.completion_tokens == 2
        assert thread.is_alive() and not result, "the held request finished early"
    finally:
        images.release.set()
        thread.join(timeout=60)
    assert "error" not in result, result.get("error")
    assert result["response"].choices[0].finish_reason in ("length", "stop")


def test_tokenize_renders_image_placeholders(image_server_app, images):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [image_part(f"{images.url}/stall")]}],
    }
    resp = httpx.post(
        f"{image_server_app.url}/tokenize", json=body, headers=image_server_app.headers, timeout=30
    )
    assert resp.status_code == 200, resp.text
    tokenizer = image_server_app.app.state.async_engine.engine.tokenizer
    text = f"<|im_start|>user\n{PAD}<|im_end|>\n<|im_start|>assistant\n"
    assert resp.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_completions_refuse_images(image_server_app):
    body = {"model": MODEL, "prompt": "hi", "multi_modal_data": {"image": "x"}}
    resp = httpx.post(
        f"{image_server_app.url}/v1/completions",
        json=body,
        headers=image_server_app.headers,
        timeout=30,
    )
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "multi_modal_data" and "/v1/chat/completions" in error["message"]
