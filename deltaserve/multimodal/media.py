"""Loading one image for a request: a `data:image/...;base64,` URI, an http(s) URL (fetched with
a time limit and a byte cap) or a `file://` path under the allowed local media directory.

Every failure is a MediaError (a ValueError) whose message names the problem and the image; the
server answers it with a 400 and goes on serving. Decoded images are RGB PIL images (transparent
pixels over white), their pixel count checked against a cap before the pixels are decoded
(decompression bombs).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    from PIL.Image import Image

DEFAULT_FETCH_TIMEOUT = 5.0  # seconds; vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # encoded bytes of one image (OpenAI's per-image limit)
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # decoded width * height of one image
_CHUNK = 64 << 10
_SHOWN = 80  # characters of a URL quoted in an error message


class MediaError(ValueError):
    """An image that cannot be used: the message says why (undecodable, too large, unreachable,
    timed out, HTTP status, path outside the allowed directory, unsupported scheme)."""


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from and how large they may be.

    `allowed_local_media_path`: the directory that `file://` URLs must resolve into (after
    symlinks and `..`); None refuses every `file://` URL (vLLM's `--allowed-local-media-path`).
    `fetch_timeout`: seconds an http(s) fetch may take in all. `max_image_bytes`: encoded size
    of one image (fetched, read or base64-decoded). `max_image_pixels`: width * height.
    `allowed_media_domains`: the only hosts http(s) images may come from, redirects included
    (vLLM's `--allowed-media-domains`); None: any host.
    """

    allowed_local_media_path: str | None = None
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_media_domains: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.fetch_timeout > 0:
            raise ValueError(f"media fetch timeout must be > 0 seconds, got {self.fetch_timeout}")
        if self.max_image_bytes < 1:
            raise ValueError(f"max_image_bytes must be >= 1, got {self.max_image_bytes}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if self.allowed_media_domains is not None:
            domains = tuple(d.strip().lower() for d in self.allowed_media_domains)
            if not all(domains):
                raise ValueError("allowed_media_domains has an empty domain")
            object.__setattr__(self, "allowed_media_domains", domains)
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path).expanduser()
            if not root.is_dir():
                what = "does not exist" if not root.exists() else "is not a directory"
                raise ValueError(
                    f"allowed_local_media_path {self.allowed_local_media_path!r} {what}"
                )
            object.__setattr__(self, "allowed_local_media_path", str(root.resolve()))


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) URLs of allowed hosts only (urllib itself refuses file: and
    others, but would follow ftp:)."""

    def __init__(self, allowed_domains: tuple[str, ...] | None) -> None:
        self.allowed_domains = allowed_domains

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        if urlparse(newurl).scheme not in ("http", "https"):
            raise MediaError(f"the image URL redirects to an unsupported URL {_short(newurl)}")
        _check_domain(newurl, self.allowed_domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_domain(url: str, allowed: tuple[str, ...] | None) -> None:
    host = (urlparse(url).hostname or "").lower()
    if allowed is not None and host not in allowed:
        raise MediaError(
            f"the image URL {_short(url)} is on host {host!r}, not one of the allowed media "
            f"domains ({', '.join(allowed)})"
        )


class MediaLoader:
    """Loads images under a MediaConfig; thread-safe (keeps no state between loads)."""

    def __init__(self, config: MediaConfig | None = None) -> None:
        self.config = config or MediaConfig()
        redirects = _CheckedRedirects(self.config.allowed_media_domains)
        self._opener = urllib.request.build_opener(redirects)

    def load_image(self, url: str) -> Image:
        """The RGB image at `url` (data:, http:, https: or file:); MediaError otherwise."""
        if not isinstance(url, str) or not url:
            raise MediaError(f"an image URL must be a non-empty string, got {url!r}")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = self._decode_data_url(url)
        elif scheme in ("http", "https"):
            data = self._fetch(url)
        elif scheme == "file":
            data = self._read_file(url)
        else:
            raise MediaError(
                f"unsupported image URL {_short(url)}: use a data:image/...;base64, URI, an "
                "http(s) URL or (with --allowed-local-media-path) a file:// URL"
            )
        what = "the data URL image" if scheme == "data" else _short(url)
        return decode_image(data, self.config.max_image_pixels, what=what)

    def check_image(self, image: Any) -> Image:
        """A PIL image given directly (the offline API): pixel cap, converted to RGB."""
        from PIL import Image as PILImage

        if not isinstance(image, PILImage.Image):
            raise MediaError(f"expected a PIL.Image.Image, got {type(image).__name__}")
        _check_pixels(image.size, self.config.max_image_pixels, "the image")
        return _to_rgb(image)

    # ---- sources ---------------------------------------------------------------------------
    def _decode_data_url(self, url: str) -> bytes:
        header, sep, payload = url[len("data:") :].partition(",")
        if not sep:
            raise MediaError("malformed data URL: no ',' before the data")
        fields = header.split(";")
        media_type = fields[0].strip().lower()
        if not media_type.startswith("image/"):
            raise MediaError(
                f"a data URL image must have an image/* media type, got {media_type or 'none'!r}"
            )
        if "base64" not in (f.strip().lower() for f in fields[1:]):
            raise MediaError("a data URL image must be base64-encoded (data:image/...;base64,)")
        payload = "".join(payload.split())  # line breaks some encoders insert
        if len(payload) // 4 * 3 > self.config.max_image_bytes + 3:
            raise MediaError(self._too_large(len(payload) // 4 * 3, "the data URL image"))
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"the data URL image is not valid base64 ({e})") from e
        if len(data) > self.config.max_image_bytes:
            raise MediaError(self._too_large(len(data), "the data URL image"))
        return data

    def _fetch(self, url: str) -> bytes:
        shown = _short(url)
        _check_domain(url, self.config.allowed_media_domains)
        timeout = self.config.fetch_timeout
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(url, headers={"User-Agent": "deltaserve"})
        try:
            with self._opener.open(request, timeout=timeout) as response:
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit():
                    if int(length) > self.config.max_image_bytes:
                        raise MediaError(self._too_large(int(length), f"the image at {shown}"))
                chunks, size = [], 0
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    # NOTE: the socket timeout bounds each read; the deadline bounds them all
                    _set_read_timeout(response, left)
                    chunk = response.read1(_CHUNK)  # what one recv brings: read() would wait
                    # for the whole chunk, past the deadline
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > self.config.max_image_bytes:
                        raise MediaError(self._too_large(size, f"the image at {shown}", "over"))
                    chunks.append(chunk)
                return b"".join(chunks)
        except MediaError:
            raise
        except urllib.error.HTTPError as e:
            raise MediaError(
                f"fetching the image at {shown} failed: HTTP {e.code} {e.reason}"
            ) from None
        except (TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(e, TimeoutError) or isinstance(reason, TimeoutError):
                raise MediaError(
                    f"fetching the image at {shown} timed out after {timeout:g} s"
                ) from e
            raise MediaError(f"the image at {shown} is unreachable ({reason})") from e
        except ValueError as e:  # e.g. a malformed URL or port
            raise MediaError(f"bad image URL {shown} ({e})") from e

    def _read_file(self, url: str) -> bytes:
        root = self.config.allowed_local_media_path
        if root is None:
            raise MediaError(
                "file:// image URLs are refused: the server was started without "
                "--allowed-local-media-path"
            )
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"a file:// URL must name a local path, got host {parsed.netloc!r}")
        raw = unquote(parsed.path)
        try:
            path = Path(raw).resolve(strict=True)
        except (OSError, RuntimeError) as e:
            raise MediaError(f"the local image {raw!r} does not exist or cannot be read") from e
        if not path.is_relative_to(root):
            raise MediaError(f"the local image {raw!r} is outside the allowed directory {root}")
        try:
            size = path.stat().st_size
            if not path.is_file():
                raise MediaError(f"the local image {raw!r} is not a file")
            if size > self.config.max_image_bytes:
                raise MediaError(self._too_large(size, f"the local image {raw!r}"))
            with open(path, "rb") as f:
                return f.read(self.config.max_image_bytes + 1)
        except OSError as e:
            raise MediaError(f"the local image {raw!r} cannot be read ({e.strerror})") from e

    def _too_large(self, size: int, what: str, over: str = "") -> str:
        got = f"over {size} bytes" if over else f"{size} bytes"
        return f"{what} is too large: {got}, the limit is {self.config.max_image_bytes} bytes"


def decode_image(data: bytes, max_pixels: int, what: str = "the image") -> Image:
    """`data` decoded with PIL to RGB; MediaError if it is not an image PIL can read or has more
    than `max_pixels` pixels (checked from the header, before decoding)."""
    import warnings

    from PIL import Image as PILImage

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            image = PILImage.open(io.BytesIO(data))
            _check_pixels(image.size, max_pixels, what)
            image.load()
    except MediaError:
        raise
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning) as e:
        raise MediaError(f"{what} has too many pixels ({e})") from e
    except (PILImage.UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"{what} cannot be decoded as an image ({e})") from e
    return _to_rgb(image)


def _check_pixels(size: tuple[int, int], max_pixels: int, what: str) -> None:
    width, height = size
    if width * height > max_pixels:
        raise MediaError(
            f"{what} is too large: {width}x{height} = {width * height} pixels, the limit is "
            f"{max_pixels} pixels"
        )
    if width < 1 or height < 1:
        raise MediaError(f"{what} is empty ({width}x{height})")


def _to_rgb(image: Image) -> Image:
    """RGB, with transparent pixels composited over white (as vLLM does)."""
    from PIL import Image as PILImage

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _set_read_timeout(response: Any, seconds: float) -> None:
    """Set the socket timeout of an open urllib response (best effort: http.client keeps the
    socket at response.fp.raw._sock)."""
    sock = getattr(getattr(getattr(response, "fp", None), "raw", None), "_sock", None)
    if sock is not None:
        sock.settimeout(max(seconds, 1e-3))


def _short(url: str) -> str:
    return repr(url if len(url) <= _SHOWN else url[:_SHOWN] + "...")


def default_thread_count() -> int:
    """Threads for loading media off the event loop (each fetch mostly waits on the network)."""
    return min(16, (os.cpu_count() or 1) + 4)
