"""A started service has already paid every method's first-time set-up: no request measures a cost curve."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def test_no_first_request_of_any_method_pays_its_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rasd.decoding.sizing.cost as cost
    from rasd.index import Document, build_index
    from rasd.serve.openai import ChatRequest, DocQARequest
    from rasd.serve.service import ServeConfig, Service
    from tests.helpers import DOCS, QUESTION

    monkeypatch.setattr(cost, "cost_dir", lambda: tmp_path / "cost")      # a machine that never measured
    cost._TRUSTED.clear()
    measured: list[int] = []
    real = cost.measure_curve

    def counting(model: Any, context_len: int, *args: Any, **kwargs: Any) -> Any:
        measured.append(context_len)
        return real(model, context_len, *args, **kwargs)

    monkeypatch.setattr(cost, "measure_curve", counting)
    index = tmp_path / "index"
    build_index([Document(text=t, title=title) for title, t in DOCS], index)
    service = Service(ServeConfig(index=str(index), threads=2))
    try:
        assert 256 in measured, "the curve of chat-sized (and document-QA-sized) prompts measured at start"
        measured.clear()
        ids, sources = service.docqa_prompt(QUESTION, 4, 16)
        out = asyncio.run(service.run(service.prepare(DocQARequest(question=QUESTION, max_tokens=8), ids, "rasd",
                                                      8, sources)))
        assert out.token_ids
        for method in ("ar", "pld", "recycling", "retrieval", "rasd"):
            chat = ChatRequest(messages=[{"role": "user", "content": "Name a planet."}], max_tokens=4,
                               method=method, temperature=0)
            ids = service.encode_chat(chat.message_dicts())
            assert asyncio.run(service.run(service.prepare(chat, ids, "pld", None))).token_ids
        assert measured == [], "no request measured a cost curve"
    finally:
        service.close()
