"""The retrieval store: documents, chunks, FAISS vectors and token suffix arrays, persisted atomically.

    from rasd.index import build_index, Index
    build_index(["docs/"], "my-index")                  # or Document(text, source, title) objects
    index = Index.open("my-index")
    hits = index.search("what is speculative decoding?", k=5)
    datastores = index.datastores()                      # SuffixArray per segment, for draft lookups

Heavy dependencies (torch, transformers, sentence-transformers, faiss) load only when first needed.
"""

from rasd.index.documents import Document, load_documents
from rasd.index.errors import (
    CommitConflict,
    IndexInputError,
    IndexOpenError,
    IndexStoreError,
    TokenizerMismatchError,
)
from rasd.index.store import Hit, Index, Segment, check_tokenizer
from rasd.index.suffix_array import SEP, SuffixArray
from rasd.index.writer import add_documents, build_index, compact_index

__all__ = ["SEP", "CommitConflict", "Document", "Hit", "Index", "IndexInputError", "IndexOpenError",
           "IndexStoreError", "Segment", "SuffixArray", "TokenizerMismatchError", "add_documents", "build_index",
           "check_tokenizer", "compact_index", "load_documents"]
