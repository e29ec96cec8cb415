"""The document-QA web page in a real headless Chromium (Debian's `chromium`, driven by Playwright).

The page is served by the same Serve app as the API (the session fixture `service` in conftest.py, shared
with test_serve.py). Checked: it loads and keeps the API key; a question streams (text visible before the
end; a screenshot is taken mid-answer, into docs/web_screenshot.png with RASD_UPDATE_SCREENSHOT=1); every
token is coloured by its source and the legend's counts equal the statistics the API returned; server errors
(400, 401) are shown; documents can be pasted and uploaded into the index. Without chromium the browser
tests skip (CI installs it).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rasd.decoding.runtime.repetition import DEFAULT_WINDOW as WINDOW
from tests.helpers import KEY

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
# The README's screenshot is refreshed only on request (RASD_UPDATE_SCREENSHOT=1): a test run leaves the
# tracked file alone, so `git status` stays clean after `make test`.
SCREENSHOT = (Path(__file__).resolve().parents[2] / "docs" / "web_screenshot.png"
              if os.environ.get("RASD_UPDATE_SCREENSHOT") == "1"
              else Path(tempfile.gettempdir()) / "rasd_web_screenshot.png")
LONG_QUESTION = ("Describe the Forth Bridge: who designed it, when it opened, how long it is and what kind of "
                 "bridge it is. Then explain how green tea is brewed.")
STEP_MS = 60_000        # any single browser wait
ANSWER_MS = 240_000     # a whole answer on two shared CPU cores


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium (.ci/run installs it)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any, service: dict[str, Any]) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(STEP_MS)
    page.goto(service["url"] + "/")
    yield page
    context.close()


def set_key(page: Any, key: str) -> None:
    page.fill("#api-key", key)
    page.dispatch_event("#api-key", "change")


def wait_for_info(page: Any) -> None:
    """Until the page shows the service's info (a request with a working key has answered)."""
    page.wait_for_function("document.getElementById('info').textContent.includes('documents')")


def error_text(page: Any) -> str:
    page.wait_for_selector("#error:not([hidden])", timeout=STEP_MS)
    return page.inner_text("#error")


def legend_counts(page: Any) -> dict[str, int]:
    counts = page.eval_on_selector_all("#legend li", "els => els.map(e => [e.dataset.source, +e.dataset.count])")
    return {source: n for source, n in counts if n}


def test_page_loads_and_keeps_the_api_key(page: Any, service: dict[str, Any]) -> None:
    assert page.title().startswith("rasd")
    for static in ("/static/app.js", "/static/style.css"):
        assert service["client"].get(static).status_code == 200
    assert service["client"].get("/static/..%2Fserve.py").status_code == 404
    # no key yet: the service's 401 is shown
    assert "401" in error_text(page) and "API key" in page.inner_text("#error")
    set_key(page, KEY)
    wait_for_info(page)
    assert page.is_hidden("#error")
    assert "rasd" in page.eval_on_selector("#method", "s => [...s.options].map(o => o.value).join(' ')")
    page.reload()
    assert page.input_value("#api-key") == KEY                                       # kept in localStorage
    wait_for_info(page)


def test_a_late_401_from_before_the_key_was_set_is_not_shown(browser: Any, service: dict[str, Any]) -> None:
    """The first load asks /v1/info without a key; if that 401 comes back after the key is set, it is stale."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(STEP_MS)
    held: list[Any] = []

    def hold_keyless(route: Any) -> None:
        if "authorization" in route.request.headers:
            route.continue_()
        else:
            held.append(route)           # answered below, after the request with the key

    page.route("**/v1/info", hold_keyless)
    page.goto(service["url"] + "/")
    page.wait_for_function("document.getElementById('api-key') !== null")
    set_key(page, KEY)
    wait_for_info(page)
    assert held, "the page did not ask for /v1/info before it had a key"
    for route in held:
        route.continue_()
    page.wait_for_timeout(1_000)
    assert page.is_hidden("#error"), page.inner_text("#error")
    assert "documents" in page.inner_text("#info")
    context.close()


def test_streamed_answer_coloured_by_source_matches_the_api_stats(page: Any, tmp_path: Path) -> None:
    set_key(page, KEY)
    wait_for_info(page)
    page.fill("#question", LONG_QUESTION)
    page.fill("#max-tokens", "160")
    page.fill("#top-k", "2")
    start = time.perf_counter()
    page.click("#ask")
    # text appears while the answer is still streaming: take the screenshot then
    page.wait_for_function("(() => { const a = document.getElementById('answer');"
                           " return a.dataset.state === 'streaming' && a.querySelectorAll('.tok').length >= 30; })()",
                           timeout=ANSWER_MS, polling=50)
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    mid_state, mid_text = page.evaluate("[document.getElementById('answer').dataset.state,"
                                        " document.getElementById('answer').textContent]")
    first_seen = time.perf_counter() - start
    page.wait_for_function("['done', 'error'].includes(document.getElementById('answer').dataset.state)",
                           timeout=ANSWER_MS)
    total = time.perf_counter() - start
    page.screenshot(path=str(tmp_path / "done.png"), full_page=True)
    print(f"30 tokens shown after {first_seen:.1f}s, answer done after {total:.1f}s: {tmp_path / 'done.png'}")
    assert page.is_hidden("#error"), page.inner_text("#error")
    final = json.loads(page.text_content("#raw-stats") or "")
    answer = page.inner_text("#answer")
    assert mid_state == "streaming" and 0 < len(mid_text.strip()) < len(answer.strip()), "no text before the end"
    assert SCREENSHOT.stat().st_size > 10_000

    # the coloured pieces are the answer, and each has a known source
    assert answer.strip() == final["answer"]
    piece_sources = set(page.eval_on_selector_all("#answer .tok", "els => els.map(e => e.dataset.source)"))
    assert piece_sources <= {"prefill", "bonus", "datastore", "documents", "context", "history", "draft", "eagle",
                             "recycling"}
    # the legend counts every committed token by source, exactly as the API's statistics do
    stats = final["rasd"]
    legend = legend_counts(page)
    assert legend == stats["committed_by_source"]
    assert sum(legend.values()) == final["usage"]["completion_tokens"] == stats["new_tokens"]
    # the repetition stop (on by default here) drops the repeated window; its finish reason is shown in words
    dropped = WINDOW if final["finish_reason"] == "repetition" else 0
    assert legend.get("prefill") == 1 and legend.get("bonus", 0) >= stats["steps"] - 1 - dropped
    accepted = stats["accepted_by_source"]   # what the verifier accepted: more only if a stop cut the last block
    assert all(legend.get(s, 0) <= n for s, n in accepted.items()), (legend, accepted)
    assert page.get_attribute("#status", "data-finish") == final["finish_reason"]
    cut = sum(accepted.values()) + 1 - sum(legend.values()) - dropped
    assert 0 <= cut < final["accept_lengths"][-1]
    if cut == 0 and not dropped:
        assert {s: n for s, n in legend.items() if s != "prefill"} == {s: n for s, n in accepted.items() if n}
    assert any(s in legend for s in ("documents", "datastore", "context")), "nothing was drafted from retrieval"
    print(f"{stats['new_tokens']} tokens, {stats['steps']} steps, legend {legend}, accepted {accepted}")
    assert page.get_attribute("#legend-check", "data-match") == "true"
    usage = final["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    status = f"prompt {usage['prompt_tokens']} tokens ({cached} from the prefix cache)"
    assert status in page.inner_text("#status")

    # one bar per verification step, as long as the block that step committed
    bars = page.eval_on_selector_all("#chart rect.step", "els => els.map(e => +e.dataset.length)")
    assert len(bars) == stats["steps"] == len(final["accept_lengths"])
    assert bars[:-1] == final["accept_lengths"][:-1] and bars[-1] == final["accept_lengths"][-1] - cut
    # speed: the live rate beside the plain-decoding estimate from the measured cost curve
    assert final["plain_decoding"]["tokens_per_s"] > 0
    assert page.inner_text("#plain-tps").endswith("tok/s") and page.inner_text("#speedup").endswith("×")
    assert "Bridges" in page.inner_text("#sources")


def test_server_errors_are_shown(page: Any) -> None:
    set_key(page, KEY)
    wait_for_info(page)
    page.fill("#question", "   ")
    page.click("#ask")
    message = error_text(page)
    assert "400" in message and "the question is empty" in message
    assert page.get_attribute("#answer", "data-state") == "error"
    set_key(page, "wrong-key")
    assert "401" in error_text(page)
    page.fill("#question", "Who designed the Forth Bridge?")
    page.click("#ask")
    page.wait_for_function("document.getElementById('answer').dataset.state === 'error'")
    assert "401" in page.inner_text("#error") and "API key" in page.inner_text("#error")


def test_documents_pasted_and_uploaded_are_added(page: Any, service: dict[str, Any]) -> None:
    before = service["client"].get("/v1/info").json()["index"]["num_documents"]
    set_key(page, KEY)
    page.fill("#doc-title", "Lighthouses")
    page.fill("#doc-text", "The Bell Rock Lighthouse off the coast of Angus is the oldest surviving sea-washed "
                           "lighthouse in the world; it was built between 1807 and 1810.")
    page.set_input_files("#doc-files", files=[{"name": "owls.txt", "mimeType": "text/plain",
                                               "buffer": b"Snowy owls hunt in daylight during the Arctic summer."}])
    page.click("#add-docs")
    page.wait_for_function("document.getElementById('docs-result').textContent.startsWith('added')",
                           timeout=ANSWER_MS)
    assert page.inner_text("#docs-result").startswith(f"added 2; the index now has {before + 2} documents")
    assert service["client"].get("/v1/info").json()["index"]["num_documents"] == before + 2
    page.click("#add-docs")                                          # nothing to add: said so, nothing sent
    assert "paste a document" in error_text(page)


def test_sourced_text_pieces_add_up_to_the_streamed_text() -> None:
    """Held-back text (stop strings, split multi-byte characters) still comes out whole, each character once."""
    from rasd.decoding.model.loading import load_model
    from rasd.serve.web import static_file
    from rasd.text import SourcedText

    tok = load_model("default").tokenizer
    text = "Caf\u00e9 cr\u00e8me \U0001f600 costs 5\u20ac.\n\nThe end. STOP and never this"
    ids = tok(text)["input_ids"]
    for stop in ([], ["STOP"], ["\n\n", "never"]):
        st = SourcedText(tok, stop)
        deltas, pieces, i = [], [], 0
        for n in [1, 3, 2] * len(ids):
            if i >= len(ids):
                break
            block = ids[i:i + n]
            i += n
            delta, new = st.push(block, ["documents"] * (len(block) - 1))
            deltas.append(delta)
            pieces += new
        full = tok.decode(ids, skip_special_tokens=True)
        hits = [full.find(s) for s in stop if s in full]
        full = full[: min(hits)] if hits else full
        rest, new = st.finish(full)
        deltas.append(rest)
        pieces += new
        assert "".join(deltas) == full == "".join(p["text"] for p in pieces), stop
        assert {p["source"] for p in pieces} == {"documents", "bonus"}
    assert static_file("index.html") is not None and static_file("../__init__.py") is None
