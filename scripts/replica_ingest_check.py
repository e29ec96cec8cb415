"""Hand check of issue 25 against a running `rasd serve --index DIR --replicas 2`: two questions land on
different replicas (the second is sent while the first is decoding, so it goes to the least loaded one), a
document is ingested through one replica, and the same questions, routed back by prefix to the replicas
that first answered them, must both retrieve it. Prints the replicas and the router's counters.

Ingests a small document into DIR: run it on a copy of an index you care about.

    python scripts/replica_ingest_check.py [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

QUESTIONS = ["Where do quokkas live?", "On which island do quokkas live?"]
DOCUMENT = {"title": "Quokkas", "text": "The quokka is a small marsupial that lives on Rottnest Island near Perth."}


def docqa(url: str, question: str, tokens: int) -> tuple[str | None, str]:
    """(the replica that answered, the title of the first source)."""
    r = httpx.post(f"{url}/v1/docqa", json={"question": question, "max_tokens": tokens, "top_k_sources": 1},
                   timeout=300)
    r.raise_for_status()
    return r.headers.get("x-rasd-replica"), r.json()["sources"][0]["title"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    url = p.parse_args().url
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(docqa, url, QUESTIONS[0], 128)
        time.sleep(2.0)
        second = pool.submit(docqa, url, QUESTIONS[1], 8)
        before = [first.result(), second.result()]
    print("before the ingest:", before)
    r = httpx.post(f"{url}/v1/documents", json={"documents": [DOCUMENT]}, timeout=300)
    r.raise_for_status()
    print("ingest through", r.headers.get("x-rasd-replica"), r.json())
    after = [docqa(url, q, 8) for q in QUESTIONS]
    print("after the ingest:", after)
    print("replicas that found the new document:", sorted({rep for rep, title in after if title == DOCUMENT["title"]}))
    print([line for line in httpx.get(f"{url}/metrics").text.splitlines()
           if line.startswith("rasd:router_requests_total")])


if __name__ == "__main__":
    main()
