"""The document-QA web page (static files served by the Serve app at `/`) and its text/source alignment.

The page colours every committed token by where it came from. The engine tags each committed token with a
source (`GenerationStream.token_sources`); the text a stream sends is not per token, though: a multi-byte
character may span tokens and the `Detokenizer` holds text back while it could still become a stop string.
`SourcedText` sends exactly the Detokenizer's deltas, each split into pieces `{"text", "source"}` by the
token every character belongs to, so the pieces of all events concatenate to the streamed text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rasd.pipelines.openai_api import Detokenizer

STATIC_DIR = Path(__file__).parent / "static"
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def static_file(name: str) -> tuple[bytes, str] | None:
    """The bytes and media type of a packaged static file, or None (no paths outside the folder)."""
    path = STATIC_DIR / name
    if "/" in name or "\\" in name or name.startswith(".") or path.suffix not in STATIC_TYPES or not path.is_file():
        return None
    return path.read_bytes(), STATIC_TYPES[path.suffix]


class SourcedText:
    """The Detokenizer's text deltas, plus each delta split into per-token pieces tagged with a source."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None):
        self.detok = Detokenizer(tokenizer, stop)
        self.tokenizer = tokenizer
        self.ends: list[int] = []      # per token: where its text ends in the decoded text so far
        self.sources: list[str] = []   # per token

    def push(self, block: list[int], sources: list[str]) -> tuple[str, list[dict[str, str]]]:
        """Feed one committed block and its per-token sources; returns (delta, pieces of the delta)."""
        start = len(self.detok.tokens)
        sent = self.detok.sent
        delta = self.detok.push(block)
        tokens = self.detok.tokens
        for j in range(start, len(tokens)):
            text = self.tokenizer.decode(tokens[: j + 1], skip_special_tokens=True).rstrip("\ufffd")
            self.ends.append(max(len(text), self.ends[-1] if self.ends else 0))
        self.sources += list(sources) + ["bonus"] * (len(block) - len(sources))
        return delta, self._pieces(sent, delta)

    def finish(self, final_text: str) -> tuple[str, list[dict[str, str]]]:
        sent = self.detok.sent
        rest = self.detok.finish(final_text)
        return rest, self._pieces(sent, rest)

    def _pieces(self, offset: int, delta: str) -> list[dict[str, str]]:
        """`delta` (the text from `offset` on) cut at token boundaries; text past the last boundary (never
        expected) goes to the last token."""
        pieces: list[dict[str, str]] = []
        pos, end = offset, offset + len(delta)
        for j, token_end in enumerate(self.ends):
            if pos >= end:
                break
            if token_end <= pos:
                continue
            upto = end if j == len(self.ends) - 1 else min(token_end, end)
            pieces.append({"text": delta[pos - offset: upto - offset], "source": self.sources[j]})
            pos = upto
        if pos < end:
            pieces.append({"text": delta[pos - offset:], "source": self.sources[-1] if self.sources else "bonus"})
        return pieces
