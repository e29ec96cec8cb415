"""The sample corpus a fresh machine has without network: CPython's language reference (`pydoc_data.topics`).

Every CPython ships the text `help("for")` prints, one document per topic (~80 topics, ~110k tokens). It is
indexed once, at first use, under $RASD_HOME/indexes/, so `make run` can ask a real question offline.
"""

from __future__ import annotations

from pathlib import Path

from rasd.paths import sample_index_path

SAMPLE_QUESTION = "How does the else clause of a for loop work, and when is it skipped?"


def sample_documents() -> list:
    """One Document per language-reference topic, titled by the topic's own heading."""
    from pydoc_data.topics import topics

    from rasd.index.documents import Document

    docs = []
    for key in sorted(topics):
        text = topics[key].strip()
        if text:
            first = text.splitlines()[0].strip()
            docs.append(Document(text=text, source=f"pydoc_data.topics:{key}", title=first or key))
    return docs


def ensure_sample_index(model: str = "default") -> Path:
    """The sample index for `model`'s tokenizer, built (atomically, by the index package) if missing."""
    import sys

    from rasd.index.writer import build_index

    path = sample_index_path(model)
    if not (path / "manifest.json").exists():
        print(f"rasd: indexing the Python language reference into {path} (once)", file=sys.stderr)
        build_index(sample_documents(), path, model=model)
    return path
