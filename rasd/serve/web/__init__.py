"""The document-QA web page: static files served by the Serve app at `/` (the text/source alignment of its
stream, `SourcedText`, lives in `rasd.text`).

The page colours every committed token by where it came from. The engine tags each committed token with a
source (`GenerationStream.token_sources`); the text a stream sends is not per token, though: a multi-byte
character may span tokens and the `Detokenizer` holds text back while it could still become a stop string.
`SourcedText` sends exactly the Detokenizer's deltas, each split into pieces `{"text", "source"}` by the
token every character belongs to, so the pieces of all events concatenate to the streamed text.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def static_file(name: str) -> tuple[bytes, str] | None:
    """The bytes and media type of a packaged static file, or None (no paths outside the folder)."""
    path = STATIC_DIR / name
    if "/" in name or "\\" in name or name.startswith(".") or path.suffix not in STATIC_TYPES or not path.is_file():
        return None
    return path.read_bytes(), STATIC_TYPES[path.suffix]
