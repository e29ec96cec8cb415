"""Reading documents: .txt/.md files, .jsonl and .parquet rows with a `text` field, folders of them.

Why strict: an index silently built from a binary file or a misspelt field name gives bad retrieval that is
hard to trace back, so undecodable or NUL-containing files and rows without text are errors naming the file
(and line). Empty documents are different: a corpus often has a few, so they are skipped with a warning, and
only a corpus with no text at all is an error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rasd.index.errors import IndexInputError

log = logging.getLogger("rasd.index")

TEXT_SUFFIXES = (".txt", ".md")
ROW_SUFFIXES = (".jsonl", ".parquet")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + ROW_SUFFIXES


@dataclass
class Document:
    """One document to index. `external_id` is the caller's own id (e.g. a jsonl `id`), kept for reference."""

    text: str
    source: str = ""
    title: str = ""
    external_id: str | None = None


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files named directly, plus the supported files found (recursively, sorted) in named folders.

    A file named directly must have a supported extension; inside folders other files and hidden entries are
    skipped, because folders of notes often hold images or editor files next to the text.
    """
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                log.warning("%s: no .txt/.md/.jsonl/.parquet files in this folder", path)
            out.extend(found)
        elif path.is_file():
            if path.suffix.lower() not in SUPPORTED_SUFFIXES:
                raise IndexInputError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; "
                                      f"use one of {', '.join(SUPPORTED_SUFFIXES)}")
            out.append(path)
        else:
            raise IndexInputError(f"{path}: no such file or folder")
    return out


def decode_text(data: bytes, name: str) -> str:
    """UTF-8 text of a file's bytes; NUL bytes or invalid UTF-8 mean a binary file, which is an error."""
    if b"\x00" in data:
        raise IndexInputError(f"{name}: looks like a binary file (contains NUL bytes); only UTF-8 text is indexed")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IndexInputError(f"{name}: not valid UTF-8 text (byte {exc.start}); "
                              "only UTF-8 text is indexed") from exc


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise IndexInputError(f"{path}: cannot read ({exc.strerror})") from exc


def read_text_file(path: Path) -> Document:
    """A .txt/.md file is one document; its title is the file name without extension."""
    text = decode_text(_read_bytes(path), str(path))
    return Document(text=text, source=str(path), title=path.stem)


def _row_document(row: Any, where: str, source: str) -> Document:
    """A Document from one jsonl/parquet row: `text` required (a string), `id` and `title` optional."""
    if not isinstance(row, dict):
        raise IndexInputError(f"{where}: expected a JSON object with a 'text' field")
    text = row.get("text")
    if not isinstance(text, str):
        what = "has no 'text' field" if text is None else f"'text' is a {type(text).__name__}, not a string"
        raise IndexInputError(f"{where}: {what}")
    ext_id = row.get("id")
    title = row.get("title")
    return Document(text=text, source=source, title="" if title is None else str(title),
                    external_id=None if ext_id is None else str(ext_id))


def read_jsonl_file(path: Path) -> Iterator[Document]:
    """One document per non-blank line."""
    text = decode_text(_read_bytes(path), str(path))
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise IndexInputError(f"{where}: invalid JSON ({exc.msg})") from exc
        yield _row_document(row, where, str(path))


def read_parquet_file(path: Path) -> Iterator[Document]:
    """One document per row; the file must have a string `text` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise IndexInputError(f"{path}: cannot read as Parquet ({str(exc).splitlines()[0]})") from exc
    if "text" not in table.column_names:
        raise IndexInputError(f"{path}: no 'text' column (columns: {', '.join(table.column_names)})")
    if not pa.types.is_string(table.schema.field("text").type) and \
            not pa.types.is_large_string(table.schema.field("text").type):
        raise IndexInputError(f"{path}: the 'text' column holds {table.schema.field('text').type}, not strings")
    keep = [c for c in ("text", "id", "title") if c in table.column_names]
    for i, row in enumerate(table.select(keep).to_pylist()):
        if row["text"] is None:
            row["text"] = ""
        yield _row_document(row, f"{path}: row {i}", str(path))


def read_file(path: Path) -> Iterator[Document]:
    """Documents of one supported file."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield read_text_file(path)
    elif suffix == ".jsonl":
        yield from read_jsonl_file(path)
    elif suffix == ".parquet":
        yield from read_parquet_file(path)
    else:
        raise IndexInputError(f"{path}: unsupported file type {suffix!r}")


def load_documents(items: Sequence[str | Path | Document] | str | Path | Document) -> list[Document]:
    """Documents from paths (files, folders) and/or in-memory Document objects, empty ones dropped.

    Empty (whitespace-only) documents are skipped with one warning; if nothing is left it is an error.
    """
    if isinstance(items, (str, Path, Document)):
        items = [items]
    docs: list[Document] = []
    for item in items:
        if isinstance(item, Document):
            if not isinstance(item.text, str):
                raise IndexInputError(f"document {item.source or item.title!r}: text must be a string")
            docs.append(item)
        else:
            for path in expand_paths([item]):
                docs.extend(read_file(path))
    kept = [d for d in docs if d.text.strip()]
    if not kept:
        raise IndexInputError("no documents with text to index" if not docs
                              else f"all {len(docs)} documents are empty")
    if len(kept) < len(docs):
        empty = [d.source or d.title or "(in memory)" for d in docs if not d.text.strip()]
        log.warning("skipped %d empty document(s): %s%s", len(empty), ", ".join(empty[:5]),
                    " ..." if len(empty) > 5 else "")
    return kept
