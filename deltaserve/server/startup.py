"""Checks `deltaserve serve` makes before it loads the model: the API key and the listening
socket. Each failure is a ValueError whose message names the flag or variable at fault (the
CLI prints it as one line)."""

from __future__ import annotations

import errno
import ipaddress
import socket

from deltaserve import env


def resolve_api_key(flag: str | None) -> str | None:
    """The key to require: --api-key, else DELTASERVE_API_KEY, else None (no authentication).
    An empty key (often an unset shell variable: `--api-key "$KEY"`) is refused rather than
    served as "no authentication"."""
    if flag is not None:
        if not flag.strip():
            raise ValueError(
                "--api-key is empty (an unset variable?); give the key, or leave --api-key out "
                "to serve without authentication"
            )
        return flag
    key = env.api_key()
    if key is not None and not key.strip():
        raise ValueError(
            "DELTASERVE_API_KEY is set but empty; set it to the key, or unset it to serve "
            "without authentication"
        )
    return key


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, ready for the server to listen on; port 0 takes any free
    port. Binding before the model loads turns a bad or busy port into an error at once."""
    if not 0 <= port <= 65535:
        raise ValueError(
            f"--port {port} is out of range (a TCP port is 1-65535, or 0 for any free port)"
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host} cannot be resolved ({e.strerror})") from e
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = "the port is in use by another process; choose another --port"
        elif e.errno == errno.EACCES:
            why = "permission denied: ports below 1024 need privileges; choose another --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = "not an address of this machine; check --host"
        else:
            why = e.strerror or str(e)
        raise ValueError(f"cannot listen on {_host_port(host, port)} ({why})") from e
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
