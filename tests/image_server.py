"""A threaded HTTP server on 127.0.0.1 serving test images (and slow, large, broken answers)."""

from __future__ import annotations

import http.server
import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from PIL import Image


def png_bytes(width: int, height: int, color: tuple[int, ...] = (200, 30, 60), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class ImageServer:
    url: str  # base URL, e.g. http://127.0.0.1:PORT
    held: threading.Event = field(default_factory=threading.Event)  # /hold was requested
    release: threading.Event = field(default_factory=threading.Event)  # lets /hold answer
    closing: threading.Event = field(default_factory=threading.Event)  # ends /stall
    requests: list[str] = field(default_factory=list)  # paths asked for, in order


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, bytes] = {}
    state: ImageServer

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        path = self.path
        self.state.requests.append(path)
        if path in self.routes:
            self._send(200, self.routes[path])
        elif path == "/hold":  # answers once the test releases it
            self.state.held.set()
            self.state.release.wait(timeout=30)
            self._send(200, self.routes["/red.png"])
        elif path == "/stall":  # answers only when the server closes
            self.state.closing.wait(timeout=30)
            self._send(200, self.routes["/red.png"])
        elif path == "/slow":  # headers only after a long wait
            time.sleep(1.5)
            self._send(200, self.routes["/red.png"])
        elif path == "/trickle":  # headers at once, then a byte every 0.1 s
            self.send_response(200)
            self.send_header("Content-Length", "40")
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        elif path == "/big-unsized":  # more bytes than the cap, no Content-Length
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 1024)
        elif path == "/redirect":
            self._redirect("/red.png")
        elif path == "/redirect-absolute":  # to the same server by its IP address
            self._redirect(f"{self.state.url}/red.png")
        elif path == "/redirect-file":
            self._redirect("file:///etc/hostname")
        else:
            self._send(404, b"not found")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@contextmanager
def image_server(routes: dict[str, bytes]) -> Iterator[ImageServer]:
    """Serve `routes` (path -> body; "/red.png" is required) plus the fixed test paths."""
    state = ImageServer("")
    handler = type("Handler", (_Handler,), {"routes": routes, "state": state})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        state.closing.set()
        server.shutdown()
        server.server_close()


# A chat template that renders image parts as Qwen3.5's does (one placeholder group each), for
# tiny test tokenizers without a template of their own.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif p.type == 'text' %}"
    "{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def png_of(image) -> bytes:
    """A PIL image as PNG bytes (lossless: decoding gives the same pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
