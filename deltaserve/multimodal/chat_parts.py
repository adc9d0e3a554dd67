"""OpenAI chat content parts -> the conversation the chat template renders, and its images.

A message's content may be a string or a list of parts: `{"type": "text", "text": ...}`,
`{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` and, in the offline API only,
vLLM's `{"type": "image_pil", "image_pil": <PIL.Image.Image>}`. A message with image parts
becomes template parts, `{"type": "image"}` per image and `{"type": "text", "text": ...}`, in
their order (Hugging Face chat templates render an image part as the model's placeholder, e.g.
Qwen3.5's `<|vision_start|><|image_pad|><|vision_end|>`); the images' sources come back in the
same order, across messages. Messages without image parts are left as they are, or, with
`join_text_parts`, their text parts are joined with newlines into one string (the server's
behaviour for text-only part lists). Parsing does no I/O: sources are loaded afterwards
(deltaserve.multimodal.media.MediaLoader), so a server can load them off its event loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltaserve.multimodal.media import MediaError, MediaLoader

IMAGE_DETAILS = ("auto", "low", "high")  # accepted, as vLLM does; the processor decides the size


@dataclass(frozen=True)
class ImageSource:
    """One image of a conversation: a URL to load, or an image given directly (offline)."""

    url: str | None = None
    image: Any = None  # a PIL.Image.Image
    where: str = ""  # the part it came from, e.g. "messages[1].content[0]", for error messages

    def load(self, loader: MediaLoader) -> Any:
        """The RGB PIL image (blocking: may fetch a URL); MediaError, naming the part, if it
        cannot be used."""
        try:
            if self.url is not None:
                return loader.load_image(self.url)
            return loader.check_image(self.image)
        except MediaError as e:
            raise MediaError(f"{self.where}: {e}" if self.where else str(e)) from e


@dataclass
class ChatInputs:
    conversation: list[dict[str, Any]]  # messages in the shape the chat template expects
    images: list[ImageSource] = field(default_factory=list)  # in prompt order


def parse_chat_messages(
    messages: Sequence[Mapping[str, Any]], *, allow_pil: bool, join_text_parts: bool
) -> ChatInputs:
    """The template conversation and image sources of OpenAI-style `messages`; ValueError naming
    the message and part at fault for a malformed or unsupported part."""
    conversation: list[dict[str, Any]] = []
    images: list[ImageSource] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        out = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            parts, found = _parse_parts(content, f"messages[{i}].content", allow_pil)
            if found:
                out["content"] = parts
                images.extend(found)
            elif join_text_parts:
                out["content"] = "\n".join(p["text"] for p in parts)
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of content parts, got "
                f"{type(content).__name__}"
            )
        conversation.append(out)
    return ChatInputs(conversation, images)


def load_images(sources: Sequence[ImageSource], loader: MediaLoader) -> list[Any]:
    """Each source loaded in order (blocking); the first failure raises its MediaError."""
    return [source.load(loader) for source in sources]


def _parse_parts(
    content: list[Any], where: str, allow_pil: bool
) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    parts: list[dict[str, Any]] = []
    images: list[ImageSource] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise ValueError(f"{at} must be a content part object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{at}: a text part needs a string 'text'")
            parts.append({"type": "text", "text": text})
        elif kind == "image_url":
            images.append(ImageSource(url=_image_url(part.get("image_url"), at), where=at))
            parts.append({"type": "image"})
        elif kind == "image_pil" and allow_pil:
            if part.get("image_pil") is None:
                raise ValueError(f"{at}: an image_pil part needs an 'image_pil' image")
            images.append(ImageSource(image=part["image_pil"], where=at))
            parts.append({"type": "image"})
        elif kind == "image_pil":
            raise ValueError(
                f"{at}: image_pil parts are for the offline API (LLM.chat); send an image_url "
                "part with a data: or http(s) URL"
            )
        else:
            supported = "text, image_url" + (", image_pil" if allow_pil else "")
            raise ValueError(
                f"{at}: unsupported content part type {kind!r} (supported: {supported})"
            )
    return parts, images


def _image_url(spec: Any, at: str) -> str:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("url"), str):
        raise ValueError(f'{at}: an image_url part needs "image_url": {{"url": "..."}}')
    detail = spec.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise ValueError(
            f"{at}: image_url.detail must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r}"
        )
    if not spec["url"]:
        raise ValueError(f"{at}: image_url.url is empty")
    return spec["url"]
