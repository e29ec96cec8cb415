"""Errors of the retrieval index, each meant to be shown to a person as one line.

One base class lets the CLI (and the service) turn every index problem into a one-line message without
catching unrelated bugs.
"""

from __future__ import annotations


class IndexStoreError(RuntimeError):
    """Base class: something about an index or its inputs that a person can fix."""


class IndexInputError(IndexStoreError, ValueError):
    """Bad documents or arguments (binary file, unsupported extension, no text, bad option)."""


class IndexOpenError(IndexStoreError):
    """An index directory cannot be opened: missing, not an index, corrupt manifest, missing/changed files."""


class TokenizerMismatchError(IndexStoreError):
    """The index's token datastore was made with another tokenizer than the one asked for."""


class CommitConflict(IndexStoreError):
    """Another writer committed the index generation this writer meant to commit (their locks did not exclude
    each other, e.g. on a network filesystem): nothing of this write was committed; it can simply be retried."""
