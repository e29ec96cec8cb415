"""The API key: resolved from the flag or `RASD_API_KEY` by whoever builds the app, blank keys refused, and
the middleware's constant-time check (pure logic; the real service is checked in test_serve.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rasd.serve.auth import API_KEY_ENV, ApiKeyMiddleware, is_open, key_matches, resolve_api_key


def test_flag_wins_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("from-flag") == "from-flag"


@pytest.mark.parametrize("bad", ["", "   ", "two words", "tab\there", "caf\u00e9"])
def test_blank_or_unsendable_keys_are_errors_not_no_auth(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError):
        resolve_api_key(bad)
    monkeypatch.setenv(API_KEY_ENV, bad)
    with pytest.raises(ValueError):
        resolve_api_key(None)


def test_build_app_and_cli_carry_the_environment_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key in the shell that runs `rasd serve` / `serve run` travels in the replica's config, so a replica
    on a Ray started elsewhere (another environment) still applies it."""
    pytest.importorskip("ray.serve")
    import argparse

    from rasd.errors import CliError
    from rasd.serve import options as serve_cli
    from rasd.serve.app import build_app
    from rasd.serve.config import ServeConfig

    monkeypatch.setenv(API_KEY_ENV, "shell-key")
    assert ServeConfig.from_dict({}).api_key == "shell-key"
    assert ServeConfig.from_dict({"api_key": "yaml-key"}).api_key == "yaml-key"
    app = build_app({})          # what the deployments receive: the resolved config object
    assert app._bound_deployment.init_args[1].api_key == "shell-key"
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    assert ServeConfig.from_args(parser.parse_args(["serve"])).api_key == "shell-key"
    assert ServeConfig.from_args(parser.parse_args(["serve", "--api-key", "flag-key"])).api_key == "flag-key"
    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(CliError, match="empty"):
        ServeConfig.from_args(parser.parse_args(["serve"]))
    with pytest.raises(ValueError, match="empty"):
        ServeConfig.from_dict({})
    monkeypatch.delenv(API_KEY_ENV)
    assert ServeConfig.from_dict({}).api_key is None


def test_comparison_and_open_paths() -> None:
    assert key_matches(b"Bearer k1", "k1")
    assert not key_matches(b"Bearer k1x", "k1") and not key_matches(None, "k1") and not key_matches(b"k1", "k1")
    assert is_open("/healthz") and is_open("/static/app.js") and is_open("/")
    assert not any(is_open(p) for p in ("/docs", "/openapi.json", "/metrics", "/v1/models", "/healthz/x"))


def _call(key: str | None, path: str, header: bytes | None) -> tuple[int, Any]:
    """Run the middleware over one request; returns (status, body); the inner app answers 200."""
    sent: list[dict[str, Any]] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body must not be read before the key is checked")

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [(b"authorization", header)] if header is not None else []
    scope = {"type": "http", "path": path, "headers": headers}
    asyncio.run(ApiKeyMiddleware(inner, lambda: key)(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def test_middleware_refuses_before_reading_the_body() -> None:
    status, body = _call("k", "/v1/completions", None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert _call("k", "/v1/completions", b"Bearer wrong")[0] == 401
    assert _call("k", "/v1/completions", b"Bearer k")[0] == 200
    assert _call("k", "/healthz", None)[0] == 200
    assert _call(None, "/v1/completions", None)[0] == 200          # no key configured: open (loopback default)


def test_a_keyless_service_answers_only_its_loopback_names_and_the_allowed_ones() -> None:
    """DNS rebinding: a web page whose name resolves to 127.0.0.1 reaches a keyless service with its own name in
    `Host`; that is a 421 before the app runs. With a key any name is answered (the page cannot authenticate)."""
    import asyncio

    from rasd.serve.auth import HostCheckMiddleware, host_name

    assert [host_name(h) for h in (b"127.0.0.1:8000", b"LOCALHOST", b"[::1]:8000", b"evil.example:80", None)] == \
        ["127.0.0.1", "localhost", "::1", "evil.example", ""]

    def status(host: bytes, key: str | None, allowed: list[str]) -> int:
        sent: list[dict] = []

        async def app(scope: dict, receive: object, send: object) -> None:
            sent.append({"type": "http.response.start", "status": 200})

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/v1/documents", "headers": [(b"host", host)]}
        asyncio.run(HostCheckMiddleware(app, lambda: key, lambda: allowed)(scope, None, send))
        return sent[0]["status"]

    assert status(b"127.0.0.1:8000", None, []) == 200 and status(b"localhost:8000", None, []) == 200
    assert status(b"evil.example", None, []) == 421 and status(b"evil.example:8000", None, ["docs.internal"]) == 421
    assert status(b"docs.internal:8000", None, ["docs.internal"]) == 200 and status(b"x.example", None, ["*"]) == 200
    assert status(b"evil.example", "a-key", []) == 200   # the key protects it


def test_the_bound_address_is_answered_and_bad_host_lists_are_refused() -> None:
    from rasd.serve.config import ConfigError, ServeConfig, bound_name

    assert bound_name("192.168.1.5") == ["192.168.1.5"] and bound_name("0.0.0.0") == bound_name("127.0.0.1") == []
    with pytest.raises(ConfigError, match="allowed_hosts"):
        ServeConfig.from_dict({"allowed_hosts": ["ok", ""]})
