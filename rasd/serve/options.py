"""`rasd serve` arguments, kept apart from `serve.py` so that other commands start without importing Ray."""

from __future__ import annotations

import argparse
from typing import Any

from rasd.serve.auth import API_KEY_ENV


def port_number(text: str) -> int:
    """A TCP port (1-65535), refused by argparse in one line before Ray starts (a bad one failed minutes later)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return port


def register(subparsers: Any) -> Any:
    p = subparsers.add_parser("serve", help="serve the model (OpenAI-compatible API + document QA) with Ray Serve")
    p.add_argument("--index", default=None, help="index folder, or `sample` for the bundled Python reference")
    p.add_argument("--model", default="default")
    p.add_argument("--draft-model", default=None, help="small causal LM sharing the target's tokenizer, "
                        "or `eesd` (the target's own early-exit self-draft)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-graphs", action="store_true",
                   help="on CUDA, run eager forwards instead of static shapes captured as CUDA graphs")
    p.add_argument("--method", default="pld", help="default method of /v1/completions and chat")
    p.add_argument("--docqa-method", default="rasd", help="default method of /v1/docqa")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer KEY` (or set {API_KEY_ENV})")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--ray-host", default="127.0.0.1",
                   help="address the Ray that `rasd serve` starts binds (default 127.0.0.1: this machine only; "
                        "a head other nodes join needs a reachable one, see docs/serving.md)")
    p.add_argument("--replicas", type=int, default=1,
                   help="model replicas behind the one endpoint; a chat's turns and repeated prompts are routed "
                        "to the replica that cached them (default threads: the cores split between them)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill a request that joins running ones this many prompt tokens per step (0: at once)")
    p.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="keep the K/V of prompt prefixes (system prompt, chat history) for later requests, up to "
                        "this many MiB (0: off)")
    p.add_argument("--history-mb", type=int, default=64,
                   help="earlier answers kept per replica as a drafting source (`history`, SuffixDecoding); 0: off")
    p.add_argument("--max-waiting", type=int, default=16, help="queued requests beyond the batch (then 429)")
    p.add_argument("--max-tokens-limit", type=int, default=1024)
    p.add_argument("--limit", action="append", metavar="NAME=VALUE",
                   help="a request size limit, repeatable: max_body_bytes, max_ingest_bytes, max_prompt_chars, "
                        "max_messages, max_stop, max_stop_chars, max_documents, max_document_chars, "
                        "max_field_chars (docs/serving.md)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the replica (default: all cores)")
    p.add_argument("--retrieval-shards", type=int, default=0,
                   help="serve the index from this many RetrievalShard actors (by segment; 0 = in the replica)")
    p.add_argument("--draft-workers", type=int, default=0,
                   help="run the `rasd` method's draft model in this many DraftWorker actors, named rasd-draft-<i> "
                        "in Ray namespace `rasd` (0 = in the replica); a dead or slow worker means no draft, "
                        "same tokens")
    p.add_argument("--draft-worker-model", default=None,
                   help="the draft workers' model (default: --draft-model, else `eagle:<--model>`, the target's "
                        "EAGLE head, when it has one, else `eesd:<--model>`, the EESD self-draft, which needs "
                        "`rasd train eesd`)")
    p.add_argument("--draft-worker-resources", default=None, metavar="JSON",
                   help='Ray custom resources each draft worker needs, e.g. \'{"rasd_draft": 1}\'')
    p.add_argument("--verifier-actor", action="store_true",
                   help="decode in a TargetVerifier actor apart from the HTTP replica (placement, clean 503 on "
                        "its death)")
    p.add_argument("--verifier-gpus", type=float, default=None, help="GPUs the verifier actor needs (implies "
                   "--verifier-actor)")
    p.add_argument("--verifier-resources", default=None, metavar="JSON",
                   help='Ray custom resources of the verifier actor, e.g. \'{"rasd_verifier": 1}\' (implies '
                        "--verifier-actor)")
    p.add_argument("--detach", action="store_true",
                   help="deploy on a local Ray cluster (started if needed) and return; `rasd serve --stop` ends it")
    p.add_argument("--stop", action="store_true", help="shut down a detached service and its local Ray cluster")
    p.set_defaults(func=_run)
    return p



def _run(args: Any) -> int:
    from rasd.serve.app import run_serve

    return run_serve(args)
