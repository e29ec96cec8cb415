"""The API key check, as an ASGI middleware: it runs before FastAPI reads or validates a body, so an unkeyed
caller learns nothing about the request schema and cannot make the replica parse a large body.

The key comes from the config (`--api-key`, `api_key:` in serve_config.yaml) or `RASD_API_KEY`, resolved by
whoever builds the app (the CLI, `serve run`) and passed in, so it applies however the service is started.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

API_KEY_ENV = "RASD_API_KEY"
# Open without a key: liveness, and the web page's static files (the page itself asks for the key).
OPEN_PATHS = frozenset({"/healthz", "/", "/favicon.ico"})
OPEN_PREFIXES = ("/static/",)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def resolve_api_key(configured: str | None) -> str | None:
    """The key in force: the configured one, else `RASD_API_KEY`; an empty or blank key is an error, never
    'no auth' (a key that was meant to apply must not silently not apply)."""
    key = configured if configured is not None else os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not key.strip():
        raise ValueError(f"the API key is empty (--api-key / api_key / {API_KEY_ENV}); unset it to serve without one")
    if any(ord(c) < 33 or ord(c) > 126 for c in key):
        raise ValueError("the API key must be printable ASCII without spaces (it travels in an HTTP header)")
    return key


def is_open(path: str) -> bool:
    """Whether a path is served without the key."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def key_matches(header: bytes | None, key: str) -> bool:
    """Constant-time comparison of an `Authorization` header with `Bearer <key>`."""
    return hmac.compare_digest(header or b"", f"Bearer {key}".encode())


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value)
    return None


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def host_name(header: bytes | None) -> str:
    """The name in a `Host` header, lower-case, without its port ("[::1]:8000" -> "::1")."""
    text = (header or b"").decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def host_allowed(name: str, allowed: list[str]) -> bool:
    """Whether a keyless service answers a request addressed to `name`: this machine's loopback names, the
    names configured (`allowed_hosts`), or any with `*`."""
    return name in LOOPBACK_NAMES or "*" in allowed or name in {h.lower() for h in allowed}


MISDIRECTED = json.dumps({"error": {
    "message": "this service answers requests addressed to its loopback name only (Host header); a keyless service "
               "refuses other names (DNS rebinding); add the name with --allowed-host, or set an API key",
    "type": "permission_error", "param": None, "code": 421}}).encode()


class HostCheckMiddleware:
    """Answers 421 to a request whose `Host` is not a loopback name or an allowed host, when the service has no
    key. Why: a keyless service on 127.0.0.1 is reachable by any web page the user opens through DNS rebinding
    (a name that resolves to 127.0.0.1), which could then ask questions or write into the index; such a
    request carries the attacker's name in `Host`. With a key the page cannot authenticate, so any name is
    answered (a service behind a proxy or on a LAN address)."""

    def __init__(self, app: Callable[..., Awaitable[None]], key_source: Callable[[], str | None],
                 hosts_source: Callable[[], list[str]]):
        self.app, self.key_source, self.hosts_source = app, key_source, hosts_source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or self.key_source() is not None
                or host_allowed(host_name(_header(scope, b"host")), self.hosts_source())):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 421,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(MISDIRECTED)).encode())]})
        await send({"type": "http.response.body", "body": MISDIRECTED})


UNAUTHORIZED = json.dumps({"error": {
    "message": "missing or wrong API key (send `Authorization: Bearer <key>`)", "type": "authentication_error",
    "param": None, "code": 401}}).encode()


class ApiKeyMiddleware:
    """Answers 401 to any HTTP request without the key, except `OPEN_PATHS`. The key is read per request from
    `key_source` (the replica sets it after the app object was built)."""

    def __init__(self, app: Callable[..., Awaitable[None]], key_source: Callable[[], str | None]):
        self.app = app
        self.key_source = key_source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.key_source()
        if scope["type"] != "http" or key is None or is_open(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        if key_matches(_header(scope, b"authorization"), key):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(UNAUTHORIZED)).encode())]})
        await send({"type": "http.response.body", "body": UNAUTHORIZED})
