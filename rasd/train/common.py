"""Shared by the trainers: prompts from a data file, the target's own continuations, one teacher forward."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from rasd.decoding.model.features import FinalNormTap
from rasd.text import encode_prompt

BUILTIN = "builtin"
SHAREGPT = Path("sharegpt") / "sharegpt_v3_first4000.jsonl.gz"


def shared_data() -> Path:
    """Where the team's benchmark data lives: $RASD_DATA, else ../shared/data (read in place, never copied)."""
    return Path(os.environ.get("RASD_DATA", "../shared/data"))


def warn_offline_prompts() -> None:
    """Say so when `builtin` cannot find ShareGPT: a head trained on the fallback is a different head."""
    print(f"note: no ShareGPT at {shared_data() / SHAREGPT} (set $RASD_DATA or run from the repository): "
          "--data builtin uses the offline Python-reference prompts", file=sys.stderr)


def _json_lines(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def _prompt_of(row: dict) -> str | None:
    """The first user turn of a Spec-Bench / MT-bench (`turns`), ShareGPT (`conversations`) or plain row."""
    if row.get("turns"):
        return str(row["turns"][0])
    for turn in row.get("conversations") or []:
        if turn.get("from") in ("human", "user"):
            return str(turn.get("value", ""))
    for key in ("prompt", "question", "instruction", "input", "text"):
        if row.get(key):
            return str(row[key])
    return None


def load_prompts(data: str, limit: int | None = None) -> list[str]:
    """Prompts from a JSONL(.gz) file, or `builtin`.

    `builtin` = the first user turns of ShareGPT conversations when the shared data is there (chat requests
    like the ones users send; Spec-Bench itself is never trained on: it is the benchmark), else requests
    about CPython's language reference (ships with Python, so training works offline anywhere).
    """
    prompts: list[str] = []
    if data == BUILTIN and (shared_data() / SHAREGPT).exists():
        return load_prompts(str(shared_data() / SHAREGPT), limit)
    if data == BUILTIN:
        from pydoc_data.topics import topics

        warn_offline_prompts()

        for key in sorted(topics):
            for para in topics[key].split("\n\n"):
                para = " ".join(para.split())
                if len(para) > 120:
                    prompts.append(f"Explain this passage of the Python reference in simple words:\n\n{para[:600]}")
    else:
        path = Path(data)
        if not path.exists():
            raise ValueError(f"data file {path} does not exist (or pass --data builtin)")
        prompts = [p for p in (_prompt_of(row) for row in _json_lines(path)) if p and p.strip()]
    if not prompts:
        raise ValueError(f"no prompts found in {data}")
    return prompts[:limit] if limit else prompts


def prompt_windows(tokenizer: Any, prompts: list[str], length: int, chat: bool = True) -> torch.Tensor:
    """[K, length] token ids: each prompt through the chat template, its last `length` tokens.

    Fixed-length windows need no padding, so generation, the teacher forward and training all see exactly
    the positions and attention that decoding sees. Prompts shorter than `length` are skipped.
    """
    rows = []
    for text in prompts:
        ids = encode_prompt(tokenizer, text, chat)
        if len(ids) >= length:
            rows.append(ids[-length:])
    if not rows:
        raise ValueError(f"no prompt has {length} tokens")
    return torch.tensor(rows, dtype=torch.long)


@dataclass
class SelfGenerated:
    """The target's greedy continuations and what one teacher-forced forward over them gives.

    tokens [K, T] (prompt P + generated G); valid [K, T] (False after the first EOS); layer_hidden [K, T, H]
    (input of decoder layer `layer`, fp16) when asked; final_hidden [K, T, H] (final-norm output, fp16) when
    asked; teacher_logp / teacher_ids [K, G, top] (top log-probs of the target at positions P-1 .. T-2).
    """

    tokens: torch.Tensor
    valid: torch.Tensor
    prompt_len: int
    layer_hidden: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's config and a sample of its weights: what its greedy text depends on."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for param in list(model.parameters())[:: max(1, len(list(model.parameters())) // 8)]:
        h.update(param.detach().reshape(-1)[:256].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def generation_key(target: torch.nn.Module, prompts: torch.Tensor, gen_tokens: int, eos: list[int]) -> str:
    """Cache key of the target's greedy continuations of `prompts`."""
    h = hashlib.sha256(model_fingerprint(target).encode())
    h.update(prompts.to(torch.int64).cpu().numpy().tobytes())
    h.update(json.dumps([list(prompts.shape), gen_tokens, eos]).encode())
    return h.hexdigest()[:24]


def greedy_continuations(target: torch.nn.Module, prompts: torch.Tensor, gen_tokens: int, batch: int,
                         eos: list[int], cache: Path | None = None, desc: str = "generating") -> torch.Tensor:
    """[K, P + G] the target's greedy continuations (padded with EOS after a stop), cached under `cache`.

    Why a cache: generation is most of a training run on a CPU (minutes), and it only depends on the model,
    the prompts and the lengths; re-training with other layers, steps or vocabulary reuses it.
    """
    device = next(target.parameters()).device
    k, p = prompts.shape
    pad = eos[0] if eos else 0
    file = cache / f"{generation_key(target, prompts, gen_tokens, eos)}.pt" if cache is not None else None
    if file is not None and file.exists():
        try:
            tokens = torch.load(file)
        except Exception as exc:   # noqa: BLE001 - a truncated or foreign file: generate again, rewrite it
            print(f"rasd: ignoring the unreadable cache {file} ({type(exc).__name__}); generating again",
                  file=sys.stderr)
            tokens = None
        if isinstance(tokens, torch.Tensor) and tokens.shape == (k, p + gen_tokens):
            return tokens
    rows = []
    for start in tqdm(range(0, k, batch), desc=desc, unit="batch"):
        x = prompts[start: start + batch].to(device)
        seq = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen_tokens, do_sample=False,
                              eos_token_id=eos or None, pad_token_id=pad)
        if seq.shape[1] < p + gen_tokens:   # every row stopped early: pad to a fixed length
            seq = torch.cat([seq, seq.new_full((seq.shape[0], p + gen_tokens - seq.shape[1]), pad)], 1)
        rows.append(seq.cpu())
    tokens = torch.cat(rows)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(file.name + ".tmp")
        torch.save(tokens, tmp)
        tmp.replace(file)
    return tokens


@torch.no_grad()
def self_generate(target: torch.nn.Module, prompts: torch.Tensor, gen_tokens: int, batch: int = 64,
                  layer: int | None = None, final: bool = False, top: int = 32,
                  eos_ids: set[int] | None = None, desc: str = "generating",
                  cache: Path | None = None) -> SelfGenerated:
    """Greedy continuations of every prompt window by the target, then one teacher forward per batch."""
    device = next(target.parameters()).device
    p = prompts.shape[1]
    eos = sorted(eos_ids or ())
    tokens = greedy_continuations(target, prompts, gen_tokens, batch, eos, cache, desc)
    tap = FinalNormTap(target) if final else None
    out: dict[str, list[torch.Tensor]] = {"valid": [], "layer": [], "final": [], "lp": [], "ids": []}
    try:
        for start in tqdm(range(0, len(tokens), batch), desc="teacher forward", unit="batch"):
            seq = tokens[start: start + batch].to(device)
            valid = torch.ones_like(seq, dtype=torch.bool)
            if eos:
                is_eos = torch.isin(seq[:, p:], torch.tensor(eos, device=device))
                after = (is_eos.long().cumsum(1) - is_eos.long()) > 0   # strictly after the first EOS
                valid[:, p:] = ~after
            res = target(seq, output_hidden_states=layer is not None)
            logp = res.logits[:, p - 1: -1].float().log_softmax(-1)          # [B, G, vocab]
            lp, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
            out["valid"].append(valid.cpu())
            out["lp"].append(lp.half().cpu())
            out["ids"].append(ids.int().cpu())
            if layer is not None:
                out["layer"].append(res.hidden_states[layer].half().cpu())
            if tap is not None:
                out["final"].append(tap.last.half().cpu())
    finally:
        if tap is not None:
            tap.remove()
    return SelfGenerated(tokens=tokens, valid=torch.cat(out["valid"]), prompt_len=p,
                         layer_hidden=torch.cat(out["layer"]) if out["layer"] else None,
                         final_hidden=torch.cat(out["final"]) if out["final"] else None,
                         teacher_logp=torch.cat(out["lp"]), teacher_ids=torch.cat(out["ids"]))


def generation_cache(model_name: str) -> Path:
    """$RASD_HOME/selfgen/<model>/: the target's cached greedy continuations (see `greedy_continuations`)."""
    from rasd.paths import selfgen_dir

    return selfgen_dir(model_name)


def split(n: int, held_out: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Train / held-out sequence indices (at least one of each when n >= 2)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = min(max(1, round(n * held_out)), n - 1) if n >= 2 else 0
    return order[n_test:], order[:n_test]


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
