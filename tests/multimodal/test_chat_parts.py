"""Chat content parts -> template conversation + image sources: order, several images per
message and per conversation, text-only content unchanged, each malformed part named."""

from __future__ import annotations

import base64

import pytest
from image_server import png_bytes
from PIL import Image

from deltaserve.multimodal.chat_parts import (
    ImageSource,
    load_images,
    parse_chat_messages,
)
from deltaserve.multimodal.media import MediaError, MediaLoader


def _url(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height)).decode()


def _img(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def test_images_in_order_across_messages():
    pil = Image.new("RGB", (3, 2), (0, 255, 0))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [_text("a"), _img("u1"), _img("u2", detail="low"), _text("b")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_pil", "image_pil": pil}, _text("c")]},
    ]
    inputs = parse_chat_messages(messages, allow_pil=True, join_text_parts=True)
    assert inputs.images == [
        ImageSource(url="u1", where="messages[1].content[1]"),
        ImageSource(url="u2", where="messages[1].content[2]"),
        ImageSource(image=pil, where="messages[3].content[0]"),
    ]
    assert inputs.conversation == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image"},
                {"type": "image"},
                {"type": "text", "text": "b"},
            ],
        },
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "c"}]},
    ]
    # the caller's messages are not modified
    assert messages[1]["content"][1] == _img("u1")


def test_text_only_content_unchanged():
    messages = [
        {"role": "user", "content": [_text("one"), _text("two")], "name": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    joined = parse_chat_messages(messages, allow_pil=False, join_text_parts=True)
    assert joined.images == []
    assert joined.conversation == [
        {"role": "user", "content": "one\ntwo", "name": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    kept = parse_chat_messages(messages, allow_pil=False, join_text_parts=False)
    assert kept.conversation == messages


def test_assistant_and_system_parts_with_images():
    messages = [
        {"role": "system", "content": [_text("look:"), _img("s")]},
        {"role": "assistant", "content": [_img("a1"), _img("a2")]},
    ]
    inputs = parse_chat_messages(messages, allow_pil=False, join_text_parts=True)
    assert [s.url for s in inputs.images] == ["s", "a1", "a2"]
    assert inputs.conversation[1]["content"] == [{"type": "image"}, {"type": "image"}]


@pytest.mark.parametrize(
    "content, allow_pil, message",
    [
        ([{"type": "input_audio"}], True, r"content\[0\]: unsupported content part type"),
        (
            [_text("x"), {"type": "image_url", "image_url": "u"}],
            True,
            r"content\[1\]: an image_url",
        ),
        ([{"type": "image_url", "image_url": {"url": 3}}], True, "an image_url part needs"),
        ([{"type": "image_url", "image_url": {"url": ""}}], True, "image_url.url is empty"),
        ([_img("u", detail="huge")], True, "detail must be one of auto, low, high"),
        ([{"type": "text", "text": 5}], True, "a text part needs a string"),
        ([{"type": "image_pil", "image_pil": None}], True, "needs an 'image_pil' image"),
        ([{"type": "image_pil", "image_pil": 1}], False, "offline API"),
        (["plain string part"], True, "must be a content part object"),
        ({"text": "dict content"}, True, "must be a string or a list of content parts"),
    ],
)
def test_bad_parts_named(content, allow_pil, message):
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": content}]
    with pytest.raises(ValueError, match=message) as info:
        parse_chat_messages(messages, allow_pil=allow_pil, join_text_parts=True)
    assert "messages[1]" in str(info.value)


def test_load_images_in_order_and_first_failure():
    loader = MediaLoader()
    pil = Image.new("L", (2, 2), 9)
    sources = [ImageSource(url=_url(5, 3)), ImageSource(image=pil), ImageSource(url=_url(2, 7))]
    images = load_images(sources, loader)
    assert [im.size for im in images] == [(5, 3), (2, 2), (2, 7)]
    assert all(im.mode == "RGB" for im in images)
    bad = ImageSource(url="data:image/png;base64,AAAA", where="messages[0].content[3]")
    with pytest.raises(MediaError, match=r"^messages\[0\].content\[3\]: .* cannot be decoded"):
        load_images([sources[0], bad], loader)


def test_template_renders_one_placeholder_group_per_image():
    """The template parts render as a Qwen-VL style template renders image parts."""
    from jinja2 import Template

    template = Template(
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
        "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
        "{% endfor %}"
    )
    messages = [{"role": "user", "content": [_img("a"), _text("what?"), _img("b")]}]
    inputs = parse_chat_messages(messages, allow_pil=False, join_text_parts=True)
    text = template.render(messages=inputs.conversation)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == f"<user>{pad}what?{pad}"
