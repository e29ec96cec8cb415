"""`Service` holds one decoding back-end and never asks which: whatever fills in `DecodingBackend` serves
its requests, load, health, info, ingest and shutdown (here a recording stand-in; the two real ones give
the same tokens in tests/distributed/test_verifier.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rasd.distributed.backend import DecodingBackend, Prepared, WarmUp
from tests.distributed.test_draft_worker import tiny_model_folder


class Recording(DecodingBackend):
    """Answers every request with its prompt reversed; records what the service asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.warm: WarmUp | None = None
        self.problem: str | None = None

    @property
    def name(self) -> str | None:
        return "elsewhere"

    @property
    def threads(self) -> int | None:
        return 7

    def start(self, warm: WarmUp) -> None:
        self.warm = warm

    async def events(self, p: Prepared, sourced: bool = False) -> AsyncIterator[tuple[str, Any]]:
        from rasd.decoding.runtime.engine import GenerationOutput
        from rasd.decoding.runtime.stats import DecodeStats

        self.calls.append("events")
        tokens = p.prompt_ids[::-1][: p.max_tokens]
        yield "tokens", tokens
        yield "done", GenerationOutput(token_ids=tokens, text="", finish_reason="length", stats=DecodeStats())

    def check_capacity(self) -> None:
        self.calls.append("check_capacity")

    def load(self) -> tuple[int, int]:
        return 3, 4

    def health_problem(self) -> str | None:
        return self.problem

    def add_segments(self) -> None:
        self.calls.append("add_segments")

    def stats(self) -> dict[str, Any]:
        return {"draft_workers": {"workers": 2}}

    def close(self) -> None:
        self.calls.append("close")


def test_the_service_serves_through_whatever_backend_it_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rasd.serve.service as service_module
    from rasd.index.writer import build_index
    from rasd.serve.openai import CompletionRequest
    from rasd.serve.service import ServeConfig, Service
    from tests.helpers import topic_documents

    folder = str(tiny_model_folder(tmp_path / "model")[0])
    docs = topic_documents()
    build_index(docs[:2], tmp_path / "idx", model=folder, chunk_tokens=24, overlap=6)
    backend = Recording()
    monkeypatch.setattr(service_module, "make_backend", lambda *args: backend)
    service = Service(ServeConfig(model=folder, index=str(tmp_path / "idx"), threads=1))
    try:
        assert backend.warm is not None and backend.warm.chat and backend.warm.docqa, "warm-up prompts built here"
        req = CompletionRequest(prompt="one two three", max_tokens=2, method="ar", temperature=0.0)
        ids = service.encode_text(req.prompt)
        service.check_capacity()
        out = asyncio.run(service.run(service.prepare(req, ids, "ar", 2)))
        assert out.token_ids == ids[::-1][:2]
        assert service.load() == (3, 4) and service.health_problem() is None
        backend.problem = "stuck"
        assert service.health_problem() == "stuck" and not service.healthy()
        info = service.info()
        assert info["verifier"] == "elsewhere" and info["draft_workers"] == {"workers": 2}
        assert service.add_documents([{"text": docs[3].text, "title": docs[3].title}])["added"] == 1
        assert service.index.num_documents == 3        # the service searches the new state itself
    finally:
        service.close()
    assert backend.calls == ["check_capacity", "events", "add_segments", "close"]
