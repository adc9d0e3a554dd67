"""Client-side helpers shared by `deltaserve smoke` and `deltaserve bench serve` (no server
imports: httpx only)."""

from __future__ import annotations


def base_url(endpoint: str) -> str:
    """`http://host:8000`, `http://host:8000/` or `http://host:8000/v1` -> `http://host:8000`."""
    url = endpoint.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the endpoint must be an http(s) URL, got {endpoint!r}")
    return url


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class SSEParser:
    """Server-sent events, one line at a time: `feed(line)` returns the data of the event that
    the line completes (a blank line ends an event; `data:` lines join with newlines; comment
    lines starting with ':' and other fields are ignored), or None."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The last event, if the stream ended without its blank line."""
        return self.feed("")
