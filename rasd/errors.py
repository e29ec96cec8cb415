"""Errors every layer may raise. `CliError` lives here, not in `rasd.cli`, so that subcommands defined in
lower packages (index, apps, eval, serve) can raise it without importing the top of the stack; `ApiError`
here, not in the HTTP layer, so that the Ray actors below it can fail a request with a status."""

from __future__ import annotations

from typing import Any


class CliError(Exception):
    """A user-facing error: the `rasd` command prints it as one line and exits with status 2."""


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        """`headers`: sent with the error response (a 429's `Retry-After`)."""
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = dict(headers or {})

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled whole: a replica's refusal crosses Ray to the ingress and keeps its HTTP status and headers."""
        return type(self), (self.status, self.message, self.type, self.param, self.headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.status)


def error_body(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
