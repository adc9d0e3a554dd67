"""Image loading: data URIs, http(s) URLs from a local server, file:// paths under the allowed
directory, and each failure a MediaError naming the problem."""

from __future__ import annotations

import base64
import io
import os
import socket
import time

import pytest
from image_server import image_server, png_bytes
from PIL import Image

from deltaserve.multimodal.media import MediaConfig, MediaError, MediaLoader, decode_image


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def assert_red(image: Image.Image, size: tuple[int, int]) -> None:
    assert image.mode == "RGB"
    assert image.size == size
    assert image.getpixel((0, 0)) == (200, 30, 60)


@pytest.fixture(scope="module")
def server():
    routes = {"/red.png": png_bytes(7, 5), "/notimage": b"<html>hello</html>"}
    with image_server(routes) as srv:
        yield srv.url


def test_data_url_decodes_to_rgb():
    assert_red(MediaLoader().load_image(data_url(png_bytes(7, 5))), (7, 5))


def test_data_url_with_line_breaks_and_jpeg():
    buf = io.BytesIO()
    Image.new("RGB", (9, 4), (0, 0, 255)).save(buf, format="JPEG", quality=100)
    encoded = base64.encodebytes(buf.getvalue()).decode()  # base64 with a newline every 76
    image = MediaLoader().load_image(f"data:image/jpeg;base64,{encoded}")
    assert image.size == (9, 4) and image.mode == "RGB"
    r, g, b = image.getpixel((4, 2))
    assert r < 10 and g < 10 and b > 245


def test_transparent_pixels_become_white():
    image = MediaLoader().load_image(data_url(png_bytes(3, 3, (10, 20, 30, 0), mode="RGBA")))
    assert image.mode == "RGB" and image.getpixel((1, 1)) == (255, 255, 255)
    gray = MediaLoader().load_image(data_url(png_bytes(3, 2, 77, mode="L")))
    assert gray.mode == "RGB" and gray.getpixel((0, 0)) == (77, 77, 77)


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png;base64,!!!notbase64", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", r"image/\* media type"),
        ("data:image/png,rawbytes", "base64-encoded"),
        ("data:image/png;base64", "no ','"),
        (data_url(b"GIF89a but not really an image"), "cannot be decoded"),
        ("ftp://example.com/a.png", "unsupported image URL"),
        ("just-a-name.png", "unsupported image URL"),
        ("", "non-empty string"),
    ],
)
def test_bad_data_urls_and_schemes(url, message):
    with pytest.raises(MediaError, match=message):
        MediaLoader().load_image(url)


def test_byte_cap_on_data_url():
    loader = MediaLoader(MediaConfig(max_image_bytes=100))
    with pytest.raises(MediaError, match="too large.*limit is 100 bytes"):
        loader.load_image(data_url(png_bytes(64, 64, (1, 2, 3)) + b"\0" * 200))


def test_pixel_cap_checked_before_decoding():
    loader = MediaLoader(MediaConfig(max_image_pixels=35))
    assert_red(loader.load_image(data_url(png_bytes(7, 5))), (7, 5))  # exactly at the cap
    with pytest.raises(MediaError, match=r"8x5 = 40 pixels, the limit is 35"):
        loader.load_image(data_url(png_bytes(8, 5)))
    # a decompression bomb: a huge, highly compressible image in few bytes
    bomb = png_bytes(6000, 6000, (0, 0, 0))
    assert len(bomb) < 200_000
    with pytest.raises(MediaError, match="too large.*6000x6000"):
        decode_image(bomb, max_pixels=1_000_000)


def test_pil_image_given_directly():
    loader = MediaLoader(MediaConfig(max_image_pixels=100))
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert loader.check_image(rgba).getpixel((0, 0)) == (255, 255, 255)
    with pytest.raises(MediaError, match="too large"):
        loader.check_image(Image.new("RGB", (11, 10)))
    with pytest.raises(MediaError, match="expected a PIL.Image.Image, got str"):
        loader.check_image("red.png")


def test_http_url(server):
    loader = MediaLoader()
    assert_red(loader.load_image(f"{server}/red.png"), (7, 5))
    assert_red(loader.load_image(f"{server}/redirect"), (7, 5))


def test_http_failures(server):
    loader = MediaLoader(MediaConfig(fetch_timeout=0.5, max_image_bytes=4096))
    with pytest.raises(MediaError, match="HTTP 404"):
        loader.load_image(f"{server}/missing.png")
    with pytest.raises(MediaError, match="cannot be decoded"):
        loader.load_image(f"{server}/notimage")
    with pytest.raises(MediaError, match="url 'file:///etc/hostname' is not allowed"):
        loader.load_image(f"{server}/redirect-file")
    with pytest.raises(MediaError, match="too large: over .* limit is 4096 bytes"):
        loader.load_image(f"{server}/big-unsized")


def test_http_declared_length_over_cap(server):
    loader = MediaLoader(MediaConfig(max_image_bytes=50))
    with pytest.raises(MediaError, match=r"too large: \d+ bytes, the limit is 50 bytes"):
        loader.load_image(f"{server}/red.png")


@pytest.mark.parametrize("path", ["/slow", "/trickle"])
def test_http_timeout(server, path):
    """A server that answers late, and one that sends its body too slowly: the timeout bounds
    the whole fetch, not each read."""
    loader = MediaLoader(MediaConfig(fetch_timeout=0.5))
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"timed out after 0.5 s"):
        loader.load_image(f"{server}{path}")
    # both answers take over 1.5 s; the fetch gives up near 0.5 s
    assert time.monotonic() - start < 1.4


def test_http_unreachable():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MediaError, match="unreachable"):
        MediaLoader().load_image(f"http://127.0.0.1:{port}/a.png")


def test_file_urls(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "red.png").write_bytes(png_bytes(7, 5))
    (tmp_path / "secret.png").write_bytes(png_bytes(2, 2))
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    (allowed / "junk.png").write_bytes(b"junk")

    with pytest.raises(MediaError, match="without --allowed-local-media-path"):
        MediaLoader().load_image(f"file://{allowed}/sub/red.png")

    loader = MediaLoader(MediaConfig(allowed_local_media_path=str(allowed)))
    assert_red(loader.load_image(f"file://{allowed}/sub/red.png"), (7, 5))
    assert_red(loader.load_image(f"file://{allowed}/sub/../sub/red%2Epng"), (7, 5))
    with pytest.raises(MediaError, match="outside the allowed directory"):
        loader.load_image(f"file://{allowed}/../secret.png")
    with pytest.raises(MediaError, match="outside the allowed directory"):
        loader.load_image(f"file://{allowed}/link.png")  # a symlink out of the directory
    with pytest.raises(MediaError, match="does not exist"):
        loader.load_image(f"file://{allowed}/nothere.png")
    with pytest.raises(MediaError, match="not a file"):
        loader.load_image(f"file://{allowed}/sub")
    with pytest.raises(MediaError, match="cannot be decoded"):
        loader.load_image(f"file://{allowed}/junk.png")
    with pytest.raises(MediaError, match="must name a local path"):
        loader.load_image(f"file://otherhost{allowed}/sub/red.png")
    small = MediaLoader(MediaConfig(allowed_local_media_path=str(allowed), max_image_bytes=10))
    with pytest.raises(MediaError, match="too large"):
        small.load_image(f"file://{allowed}/sub/red.png")


def test_config_checks(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        MediaConfig(allowed_local_media_path=str(tmp_path / "nope"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        MediaConfig(allowed_local_media_path=str(tmp_path / "f"))
    with pytest.raises(ValueError, match="timeout must be > 0"):
        MediaConfig(fetch_timeout=0)
    with pytest.raises(ValueError, match="max_image_bytes"):
        MediaConfig(max_image_bytes=0)


def test_allowed_media_domains(server):
    port = server.rsplit(":", 1)[1]
    only_local = MediaLoader(MediaConfig(allowed_media_domains=("127.0.0.1",)))
    assert_red(only_local.load_image(f"{server}/red.png"), (7, 5))
    elsewhere = MediaLoader(MediaConfig(allowed_media_domains=("images.example.com",)))
    with pytest.raises(MediaError, match="on host '127.0.0.1', not one of the allowed media"):
        elsewhere.load_image(f"{server}/red.png")
    # a redirect is checked too: localhost is allowed, the 127.0.0.1 it redirects to is not
    to_other_host = MediaLoader(MediaConfig(allowed_media_domains=("localhost",)))
    with pytest.raises(MediaError, match="on host '127.0.0.1'"):
        to_other_host.load_image(f"http://localhost:{port}/redirect-absolute")
    with pytest.raises(ValueError, match="empty domain"):
        MediaConfig(allowed_media_domains=("",))
