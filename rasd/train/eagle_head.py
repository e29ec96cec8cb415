"""`rasd train eagle`: train the target's EAGLE head (`rasd.decoding.model.eagle_head`) on the target's own features.

Data (EAGLE-1/2's recipe): real chat conversations as they are (`builtin`: ShareGPT from ../shared/data, else
requests about CPython's language reference), one teacher forward of the target per batch, which gives at
every position the final-norm feature f_t (stored fp16 on disk, so epochs and experiments never recompute
it) and, for free, the target's greedy token (its counts choose the draft vocabulary). Never Spec-Bench,
LongBench or other benchmark data.

Training: the head reads (f_t, x_{t+1}) and predicts f_{t+1}; the loss is EAGLE's feature regression
(smooth L1) plus the cross-entropy from the target's distribution at t+1 (softmax of its LM head over the
draft vocabulary, computed from the stored f_{t+1}) to the head's. Inputs get EAGLE's uniform noise, so the
head tolerates its own imperfect features deeper in a tree.

Held out: the target's greedy continuations of prompts from conversations never trained on. Depth-d
agreement = the head's top-1 (top-4) after d - 1 steps drafted on its own predicted features with the right
tokens, equal to the target's greedy token: what an EAGLE tree's level d gets accepted with.
"""

from __future__ import annotations

import copy
import hashlib
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rasd.decoding.model import fast_forward
from rasd.decoding.model.eagle_head import EagleHead, save_head
from rasd.decoding.model.features import FinalNormTap, final_norm
from rasd.train.common import greedy_continuations, model_fingerprint, write_json
from rasd.train.config import EagleConfig

DEPTHS = 4
SAMPLE_SEED_STRIDE = 1_000_003   # draw k of a prompt chunk is seeded seed + chunk start + k * this: no two meet


def conversation_ids(tokenizer: Any, rows: list[dict], seq_len: int, min_len: int = 32) -> list[list[int]]:
    """Each conversation through the chat template (all turns), its first `seq_len` tokens."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    from rasd.text import as_id_list, has_chat_template

    out, chars = [], seq_len * 8    # no turn needs more characters than this to fill seq_len tokens
    for row in rows:
        turns = [{"role": roles.get(t.get("from", ""), "user"), "content": str(t.get("value", ""))[:chars]}
                 for t in row.get("conversations") or [] if str(t.get("value", "")).strip()]
        if not turns:
            continue
        if has_chat_template(tokenizer):
            ids = as_id_list(tokenizer.apply_chat_template(turns, tokenize=True))
        else:
            ids = as_id_list(tokenizer("\n\n".join(t["content"] for t in turns))["input_ids"])
        if len(ids) >= min_len:
            out.append(ids[:seq_len])
    return out


def user_turns(row: dict, turns: tuple[int, ...] = (1,)) -> list[str]:
    """The row's user turns numbered `turns` (1-based; the first is what `_prompt_of` gives), those it has.

    Later turns are more prompts from the same conversations: the target answers each alone, which is still
    its own distribution, so a head can keep learning after the first turns are used up."""
    from rasd.train.common import _prompt_of

    said = [str(t.get("value", "")) for t in row.get("conversations") or [] if t.get("from") in ("human", "user")]
    if not said:
        first = _prompt_of(row)
        said = [first] if first else []
    return [said[k - 1] for k in turns if 0 < k <= len(said) and said[k - 1]]


def regenerated_data(target: Any, rows: list[dict], gen_tokens: int, cache: Path | None, window: int = 32,
                     batch: int = 128, turns: tuple[int, ...] = (1,), gen_dtype: str = "float32",
                     temperature: float = 0.0, seed: int = 0, samples: int = 1, taps: tuple[int, ...] = (),
                     limit: int | None = None) -> dict[str, Any]:
    """The target's answers (greedy, or sampled at `temperature`) to each conversation's user turns `turns`
    (default the first), with their features (EAGLE-3's data).

    Each answer is a `window`-token prompt (the turn's end through the chat template) + up to `gen_tokens`
    new tokens, cut after the first EOS. The final-norm features are taken from the generation's own forwards
    (a hook), so no second teacher pass runs: on this CPU generation is the cost (≈ 150 tokens/s at batch
    128), the pass would add half as much again. Cached (`selfgen`) per `batch` prompts, so a run on more
    conversations reuses a smaller run's answers and an interrupted run resumes.
    `gen_dtype`: answers and features from a copy of the target in this dtype (`rasd.train.answers`: bf16 is
    several times faster on AMX CPUs and GPUs; its text is its own, not the fp32 target's greedy text).
    `temperature` > 0: sampled answers (seeded per chunk), more distinct text from the same prompts; `samples`
    of them per prompt, each draw with its own seeds (draw 0 keeps the seeds a single draw always had, so its
    cached chunks are reused). `taps`: the features carry those layers too (a fused head's; cached apart; a
    chunk cached without them gets them from one teacher forward of its text). `limit`: only the first this many
    prompts (in turn order), so a run can stop at the chunks a budget allows and a longer one extends it.
    Returns what `extract_features` does: {"tokens": [list], "feats": [fp16 [n_i, H]], "counts": [vocab]}.
    """
    from rasd.train.common import prompt_windows

    prompts = [p for k in turns for r in rows for p in user_turns(r, (k,))]
    windows = prompt_windows(target.tokenizer, prompts, window)[:limit]
    eos = sorted(set(target.eos_token_ids or ()))
    vocab = target.model.get_output_embeddings().weight.shape[0]
    out: dict[str, Any] = {"tokens": [], "feats": [], "counts": torch.zeros(vocab, dtype=torch.long)}
    _check_samples(samples, temperature)
    model = _generation_copy(target.model, gen_dtype)
    chunks = [(draw, s) for draw in range(samples) for s in range(0, len(windows), batch)]
    for draw, s in tqdm(chunks, desc=f"answers with features ({batch} a chunk)", unit="chunk"):
        part = _answers_chunk(model, windows[s: s + batch], gen_tokens, eos, cache, temperature,
                              seed + s + draw * SAMPLE_SEED_STRIDE, taps)
        out["tokens"] += part["tokens"]
        out["feats"] += part["feats"]
        out["counts"] += part["counts"]
    return out


def _check_samples(samples: int, temperature: float) -> None:
    """More than one answer per prompt needs sampling: greedy answers would all be the same text."""
    if samples < 1:
        raise ValueError(f"--samples {samples}: give a positive number of answers per prompt")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"--samples {samples} needs --temperature > 0: greedy answers to a prompt are all the same")


def _generation_copy(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The model itself, or a copy of it in `dtype` (the target is left as it is: held-out data uses it)."""
    from rasd.decoding.model.loading import resolve_dtype

    wanted = resolve_dtype(dtype)
    if wanted == next(model.parameters()).dtype:
        return model
    return copy.deepcopy(model).to(wanted).eval()


def _answers_chunk(model: torch.nn.Module, windows: torch.Tensor, gen_tokens: int, eos: list[int],
                   cache: Path | None, temperature: float = 0.0, seed: int = 0, taps: tuple[int, ...] = ()
                   ) -> dict[str, Any]:
    """One chunk of `regenerated_data`, read from / written to the cache (written whole, atomically)."""
    from rasd.train.common import generation_key

    key, dtype = generation_key(model, windows, gen_tokens, eos), next(model.parameters()).dtype
    if temperature > 0 or dtype != torch.float32:   # greedy fp32 keeps the key earlier caches were written under
        key += "-" + hashlib.sha256(f"{dtype} {temperature} {seed}".encode()).hexdigest()[:8]
    tapped = "-taps" + "-".join(str(i) for i in taps) if taps else ""
    file = cache / f"{key}{tapped}-features.pt" if cache is not None else None
    data = _read_shard(file, len(windows))
    if data is not None:
        return data
    reusable = taps and cache is not None and fast_forward.supports(model)   # else generation says why not
    plain = _read_shard(cache / f"{key}-features.pt", len(windows)) if reusable else None
    data = (_with_taps(model, plain, taps) if plain is not None
            else _generate_with_features(model, windows, gen_tokens, eos, temperature, seed, taps))
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, file.with_name(file.name + ".tmp"))
        file.with_name(file.name + ".tmp").replace(file)
    return data


def _with_taps(model: torch.nn.Module, plain: dict[str, Any], taps: tuple[int, ...]) -> dict[str, Any]:
    """A chunk of answers cached without taps, its features taken again with them by one teacher forward of the
    same copy of the target: the same text, so a fused head reuses a plain draw instead of writing it anew."""
    from rasd.train import answers

    feats = answers.teacher_features(model, plain["tokens"], taps)
    return {"tokens": plain["tokens"], "feats": feats, "counts": plain["counts"]}


@torch.no_grad()
def _generate_with_features(model: torch.nn.Module, windows: torch.Tensor, gen_tokens: int, eos: list[int],
                            temperature: float = 0.0, seed: int = 0, taps: tuple[int, ...] = ()) -> dict[str, Any]:
    """Answers [K, P + G'] and the final-norm output (after `taps`' layers, if any) of every generation forward:
    greedy, or sampled at `temperature` (Llama-style models: `rasd.train.answers`, batched on one in-place cache
    per layer; others: HF `generate`, greedy only).

    The prefill gives the prompt's P features, each step one more: P + G' - 1 in all (the last token is
    never forwarded, so an answer without EOS loses its last token). Greedy-token counts: the next token of
    every answer position, the LM head's argmax over the prompt's features."""
    from rasd.train import answers

    device = next(model.parameters()).device
    if fast_forward.supports(model):
        gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
        seq, feats = answers.answers_with_features(model, windows, gen_tokens, temperature, gen, eos, taps)
    elif temperature > 0 or taps:
        raise ValueError(f"sampled answers and tapped layers need a Llama-style model; {type(model).__name__} "
                         f"is not one")
    else:
        seq, feats = _hf_answers(model, windows, gen_tokens, eos)
    p, vocab = windows.shape[1], model.get_output_embeddings().weight.shape[0]
    dtype = next(model.parameters()).dtype
    final = feats[:, : p - 1, -model.config.hidden_size:]
    prompt_greedy = model.get_output_embeddings()(final.to(device, dtype)).argmax(-1).cpu()
    counts = torch.bincount(prompt_greedy.reshape(-1), minlength=vocab)[:vocab]
    tokens, kept = [], []
    for i, row in enumerate(seq.tolist()):
        stop = next((j for j in range(p, len(row)) if row[j] in eos), len(row) - 1)
        n = min(stop + 1, feats.shape[1])
        tokens.append(row[:n])
        kept.append(feats[i, :n].clone())
        counts += torch.bincount(torch.tensor(row[p:n]), minlength=vocab)[:vocab]
    return {"tokens": tokens, "feats": kept, "counts": counts}


def _hf_answers(model: torch.nn.Module, windows: torch.Tensor, gen_tokens: int, eos: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `generate`'s greedy answers [K, P + G'] and its forwards' final-norm outputs [K, P + G' - 1, H]."""
    collected: list[torch.Tensor] = []
    handle = final_norm(model).register_forward_hook(lambda _m, _a, out: collected.append(out.half().cpu()))
    device = next(model.parameters()).device
    try:
        seq = model.generate(windows.to(device), attention_mask=torch.ones_like(windows).to(device),
                             max_new_tokens=gen_tokens, do_sample=False, eos_token_id=eos or None,
                             pad_token_id=eos[0] if eos else 0).cpu()
    finally:
        handle.remove()
    return seq, torch.cat(collected, dim=1)


def sequences_key(sequences: list[list[int]], salt: str = "") -> str:
    """A short hash of token sequences (a shard's file name: a longer run reuses a shorter one's shards)."""
    h = hashlib.sha256(salt.encode())
    for seq in sequences:
        h.update(torch.tensor(seq, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def extract_features(target: torch.nn.Module, sequences: list[list[int]], folder: Path | None, batch: int = 8,
                     shard: int = 64, taps: tuple[int, ...] = ()) -> dict[str, Any]:
    """Final-norm features (fp16) of every position, the sequences and the target's greedy-token counts; with
    `taps`, those layers' normalised outputs before the final features ([n_i, (len(taps) + 1) H],
    `FinalNormTap.stacked`).

    Written in shards of `shard` sequences under `folder` (resumable: existing shards are read, not recomputed).
    Returns {"tokens": [list], "feats": [tensor [n_i, H]], "counts": tensor [vocab]}.
    """
    vocab = target.get_output_embeddings().weight.shape[0]
    out: dict[str, Any] = {"tokens": [], "feats": [], "counts": torch.zeros(vocab, dtype=torch.long)}
    tap = FinalNormTap(target, taps)
    salt = f"taps={list(taps)}" if taps else ""
    try:
        for s in tqdm(range(0, len(sequences), shard), desc="target features", unit="shard"):
            part = sequences[s: s + shard]
            file = folder / f"shard-{sequences_key(part, salt)}.pt" if folder is not None else None
            data = _read_shard(file, len(part))
            if data is None:
                data = _shard_features(target, tap, part, batch, vocab)
                if file is not None:
                    file.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(data, file.with_name(file.name + ".tmp"))
                    file.with_name(file.name + ".tmp").replace(file)
            out["tokens"] += part
            out["feats"] += data["feats"]
            out["counts"] += data["counts"]
    finally:
        tap.remove()
    return out


def _read_shard(file: Path | None, n: int) -> dict[str, Any] | None:
    if file is None or not file.exists():
        return None
    try:
        data = torch.load(file)
    except Exception:   # noqa: BLE001 - a shard cut by a crash: compute it again
        return None
    return data if isinstance(data, dict) and len(data.get("feats", [])) == n else None


def _shard_features(target: torch.nn.Module, tap: FinalNormTap, part: list[list[int]], batch: int, vocab: int
                    ) -> dict[str, Any]:
    device = next(target.parameters()).device
    feats, counts = [], torch.zeros(vocab, dtype=torch.long)
    for b in range(0, len(part), batch):
        rows = part[b: b + batch]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        logits = target(ids.to(device), attention_mask=mask.to(device)).logits   # right padding: causal rows exact
        greedy = logits.argmax(-1).cpu()
        for i, r in enumerate(rows):
            feats.append(tap.last[i, : len(r)].half().cpu())
            counts += torch.bincount(greedy[i, : len(r)], minlength=vocab)[:vocab]
    return {"feats": feats, "counts": counts}


def draft_vocabulary(counts: torch.Tensor, size: int, always: set[int] | None = None) -> torch.Tensor | None:
    """The `size` tokens the target writes most (its greedy tokens), sorted; None = the whole vocabulary."""
    if size <= 0 or size >= len(counts):
        return None
    counts = counts.double().clone()
    for tok in always or ():
        if 0 <= tok < len(counts):
            counts[tok] = float("inf")
    return counts.topk(size).indices.sort().values


def _batch(tokens: list[list[int]], feats: list[torch.Tensor], idx: list[int]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T], feats [B, T, H] (float32), valid [B, T] for sequences idx, right-padded."""
    width = max(len(tokens[i]) for i in idx)
    hidden = feats[idx[0]].shape[-1]
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    f = torch.zeros(len(idx), width, hidden)
    valid = torch.zeros(len(idx), width, dtype=torch.bool)
    for j, i in enumerate(idx):
        n = len(tokens[i])
        ids[j, :n], f[j, :n], valid[j, :n] = torch.tensor(tokens[i]), feats[i].float(), True
    return ids, f, valid


class _StepCache:
    """Keys/values of the first (teacher-input) pass kept for the second pass to attend to (autograd-safe)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
            return k, v
        return torch.cat([self.keys, k], dim=-2), torch.cat([self.values, v], dim=-2)


def _second_pass_mask(n1: int, n2: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive [1, 1, n2, n1 + n2]: pass-2 query j sees pass-1 keys 0..j (true context) and only itself.

    That is what a depth-2 tree node sees when decoding: the committed context up to its root, then its own
    path (`_batch_hits` builds the same mask)."""
    j = torch.arange(n2, device=device)[:, None]
    visible = torch.cat([torch.arange(n1, device=device)[None] <= j, torch.eye(n2, dtype=torch.bool, device=device)],
                        dim=1)
    return torch.zeros(visible.shape, device=device).masked_fill_(~visible, torch.finfo(torch.float32).min)[None, None]


def _step_loss(head: EagleHead, pred: torch.Tensor, true: torch.Tensor, target_logp: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(smooth L1, cross-entropy from the target's distribution `target_logp`, top-1 agreement), masked means."""
    denom = mask.sum().clamp(min=1)
    reg = (F.smooth_l1_loss(pred, true, reduction="none").mean(-1) * mask).sum() / denom
    logq = head.logits(pred).log_softmax(-1)
    ce = (-(target_logp.exp() * logq).sum(-1) * mask).sum() / denom
    top1 = ((logq.argmax(-1) == target_logp.argmax(-1)).float() * mask).sum() / denom
    return reg, ce, top1


def head_loss(head: EagleHead, ids: torch.Tensor, feats: torch.Tensor, valid: torch.Tensor, noise: float = 0.0,
              w_cls: float = 1.0, gen: torch.Generator | None = None, ttt: bool = False
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss on sequences: input (f_t, x_{t+1}) for t < T-1, targets f_{t+1} and the target's p_{t+1}.

    `ttt` (EAGLE-3's training-time test, two steps): a second pass reads the head's own predictions
    (f̂_{t+1}, x_{t+2}) as a depth-2 node does, so the head learns to draft on its own features too."""
    inp = feats[:, :-1]
    if noise:
        inp = inp + ((torch.rand(inp.shape, generator=gen) * 2 - 1) * noise).to(inp.device)   # CPU draws: seeded alike
    pos = torch.arange(1, ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    kv = _StepCache() if ttt else None
    pred = head(inp, ids[:, 1:], pos, kv=kv)                              # [B, T-1, H]: f̂_{t+1}
    true = head.final_features(feats)                                     # the tapped layers are inputs only
    with torch.no_grad():
        target_logp = head.logits(true[:, 1:]).log_softmax(-1)           # [B, T-1, V']: once for both passes
    reg, ce, top1 = _step_loss(head, pred, true[:, 1:], target_logp, (valid[:, 1:] & valid[:, :-1]).float())
    loss, parts = reg + w_cls * ce, {"reg": reg.item(), "ce": ce.item(), "top1": top1.item()}
    if ttt and ids.shape[1] > 2:
        n1, n2 = pred.shape[1], pred.shape[1] - 1
        pred2 = head(pred[:, :-1], ids[:, 2:], pos[:, 1:] + 1, kv=kv, mask=_second_pass_mask(n1, n2, ids.device))
        reg2, ce2, top2 = _step_loss(head, pred2, true[:, 2:], target_logp[:, 1:],
                                     (valid[:, 2:] & valid[:, :-2]).float())
        loss = loss + reg2 + w_cls * ce2
        parts.update(ce2=ce2.item(), top1_d2=top2.item())
    return loss, parts


@torch.no_grad()
def depth_agreement(head: EagleHead, sequences: torch.Tensor, feats: torch.Tensor, valid: torch.Tensor,
                    prompt_len: int, depths: int = DEPTHS, batch: int = 16) -> dict[str, list[float]]:
    """Top-1 / top-4 agreement with the target's greedy tokens at draft depths 1..`depths` (module doc).

    sequences [K, T]: the target's greedy text (prompt + continuation); feats [K, T, H] its features; valid
    [K, T] (False after EOS). Every root r of the continuation drafts a chain as decoding does: the head's
    cache holds the true context (f_{t-1}, x_t) for t <= r, a chain node reads its parent's predicted feature
    and attends to the context up to its root and to its own chain, never to another root's.
    """
    hit1, hit4, ok = position_hits(head, sequences, feats, valid, prompt_len, depths, batch)
    total = [int(o.sum()) for o in ok]
    return {"top1": [round(int(h.sum()) / max(n, 1), 4) for h, n in zip(hit1, total, strict=True)],
            "top4": [round(int(h.sum()) / max(n, 1), 4) for h, n in zip(hit4, total, strict=True)], "positions": total}


def position_hits(head: EagleHead, sequences: torch.Tensor, feats: torch.Tensor, valid: torch.Tensor,
                  prompt_len: int, depths: int = DEPTHS, batch: int = 16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per depth, whether the head's top-1 / top-4 holds the target's token at every held-out position, and
    which positions count: three [D, K, R] bool tensors (R roots per sequence), scored `batch` sequences at a
    time. Kept per position so that two heads can be compared on the same positions (a paired difference is
    far tighter than two agreements' own noise: `rasd.train.head_compare`)."""
    device = _device_of(head)
    parts = [_batch_hits(head, sequences[s: s + batch].to(device), feats[s: s + batch].to(device).float(),
                         valid[s: s + batch].to(device), prompt_len, depths) for s in range(0, len(sequences), batch)]
    return tuple(torch.cat([p[i] for p in parts], 1) for i in range(3))


def _batch_hits(head: EagleHead, seq: torch.Tensor, feats: torch.Tensor, valid: torch.Tensor, prompt_len: int,
                depths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, t = seq.shape
    roots = torch.arange(max(1, prompt_len - 1), t - depths, device=seq.device)              # [R]
    hit1, hit4, ok = [], [], []
    for d, top4 in enumerate(chain_top_tokens(head, seq, feats, roots, depths, top=4)):
        want = seq[:, roots + d + 1]                                                           # [K, R]
        counts = valid[:, roots + d + 1] & (roots + d + 1 >= prompt_len)[None]
        hit1.append((top4[..., 0] == want) & counts)
        hit4.append((top4 == want[..., None]).any(-1) & counts)
        ok.append(counts)
    return torch.stack(hit1), torch.stack(hit4), torch.stack(ok)


@torch.no_grad()
def chain_top_tokens(head: EagleHead, seq: torch.Tensor, feats: torch.Tensor, roots: torch.Tensor, depths: int,
                     top: int = 1) -> Iterator[torch.Tensor]:
    """Per depth 1..`depths`, the head's `top` tokens [K, R, top] (target ids) for the chain node at that depth
    of every root in `roots` [R], the chain fed the text's own tokens (what it drafts while it is right).

    As decoding drafts: the head's cache holds the true context (f_{t-1}, x_t) for t <= r, a chain node reads
    its parent's predicted feature and attends to the context up to its root and to its own chain, never to
    another root's. seq [K, T]; feats [K, T, H] the target's final-norm features; roots < T - depths."""
    from rasd.decoding.step.cache import GrowableLayer

    k, t = seq.shape
    kv = GrowableLayer()
    device = seq.device
    pred = head(feats[:, :-1], seq[:, 1:], torch.arange(1, t, device=device)[None].expand(k, -1), kv=kv)
    cur = pred[:, roots - 1]                                                    # f̂_r [K, R, H]; pred[:, j] = f̂_{j+1}
    key_pos = torch.arange(1, t, device=device)                                 # true keys' positions
    vocab = head.vocab.to(device) if head.vocab is not None else None
    for d in range(depths):
        ids = head.logits(cur).topk(top, dim=-1).indices
        yield vocab[ids] if vocab is not None else ids
        if d + 1 == depths:
            return
        # next chain node of every root: input (f̂_{r+d}, x_{r+d+1}) at position r + d + 1
        own = torch.eye(len(roots), dtype=torch.bool, device=device)
        visible = [key_pos[None, :] <= roots[:, None]] + [own] * (d + 1)
        mask = torch.zeros(len(roots), t - 1 + len(roots) * (d + 1), device=device)
        mask.masked_fill_(~torch.cat(visible, 1), torch.finfo(mask.dtype).min)
        pos = (roots + d + 1)[None].expand(k, -1)
        cur = head(cur, seq[:, roots + d + 1], pos, kv=kv, mask=mask[None, None])


def head_chain_labels(head: EagleHead, seq: torch.Tensor, feats: torch.Tensor, roots: torch.Tensor,
                      k_max: int) -> torch.Tensor:
    """AdaEAGLE's label for the head at every root [K, R]: how many tokens of its greedy k_max-token chain match
    the text (the common-prefix length). While the chain matches, its inputs are the text's tokens, so the
    chain of `chain_top_tokens` is the one the head drafts; after the first miss nothing counts."""
    run = torch.ones(seq.shape[0], len(roots), dtype=torch.bool, device=seq.device)
    label = torch.zeros(seq.shape[0], len(roots), dtype=torch.long, device=seq.device)
    for d, top1 in enumerate(chain_top_tokens(head, seq, feats, roots, k_max)):
        run &= top1[..., 0] == seq[:, roots + d + 1]
        label += run.long()
    return label


# ---------------------------------------------------------------------------------------------- training


def _device_of(head: EagleHead) -> torch.device:
    """Where the head's weights are: batches read from the CPU feature cache are moved there (a GPU trains)."""
    return next(head.parameters()).device


def _lr(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over 20 steps, then cosine decay to a tenth."""
    return lr * min(1.0, (step + 1) / 20) * (0.55 + 0.45 * math.cos(math.pi * step / max(steps, 1)))


def train_head(head: EagleHead, tokens: list[list[int]], feats: list[torch.Tensor], steps: int, batch: int = 8,
               lr: float = 1e-3, noise: float = 0.05, w_cls: float = 1.0, seed: int = 0,
               checkpoint: Path | None = None, progress: bool = True, ttt: bool = False) -> dict[str, Any]:
    """Optimise fc + layer on the stored features; resumable from `checkpoint` (same settings)."""
    params = [p for p in head.parameters() if p.requires_grad]
    device = _device_of(head)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    order = torch.Generator().manual_seed(seed + 1)
    start, history = 0, []
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location=device)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"].cpu())
        order.set_state(state["order"].cpu())
        start, history = state["step"], state["history"]
    head.train()
    bar = tqdm(range(start, steps), desc="training EAGLE head", unit="step", initial=start, total=steps,
               disable=not progress)
    for step in bar:
        idx = torch.randint(len(tokens), (min(batch, len(tokens)),), generator=order).tolist()
        ids, f, valid = (t.to(device) for t in _batch(tokens, feats, idx))
        loss, parts = head_loss(head, ids, f, valid, noise, w_cls, gen, ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr)
        opt.step()
        history.append(parts)
        recent = history[-50:]
        bar.set_postfix(ce=f"{sum(h['ce'] for h in recent) / len(recent):.3f}",
                        top1=f"{sum(h['top1'] for h in recent) / len(recent):.3f}")
        if checkpoint is not None and ((step + 1) % 200 == 0 or step + 1 == steps):
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            tmp = checkpoint.with_name(checkpoint.name + ".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "order": order.get_state(), "step": step + 1, "history": history}, tmp)
            tmp.replace(checkpoint)
    head.eval()
    recent = history[-50:] or [{"ce": float("nan"), "top1": float("nan"), "reg": float("nan")}]
    return {key: round(sum(h[key] for h in recent) / len(recent), 4) for key in recent[-1]}


def held_out_set(target: torch.nn.Module, prompts: torch.Tensor, gen_tokens: int, eos: set[int],
                 cache: Path | None, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's greedy continuations of `prompts` [K, P] (cached), their features and validity."""
    seqs = greedy_continuations(target, prompts, gen_tokens, 32, sorted(eos), cache, desc="held-out text")
    data = extract_features(target, [s.tolist() for s in seqs], None, batch=16, shard=len(seqs), taps=taps)
    feats = torch.stack(data["feats"])
    valid = torch.ones_like(seqs, dtype=torch.bool)
    p = prompts.shape[1]
    if eos:
        is_eos = torch.isin(seqs[:, p:], torch.tensor(sorted(eos)))
        valid[:, p:] = ~((is_eos.long().cumsum(1) - is_eos.long()) > 0)
    return seqs, feats, valid


def add_parser(sub: Any) -> None:
    EagleConfig.add_parser(sub, run)


def held_out_split(rows: list[dict], eval_seqs: int) -> tuple[list[dict], list[dict]]:
    """(rows to train on, held-out rows): the last `eval_seqs` rows (at most a tenth) are never trained on."""
    n_eval = min(eval_seqs, max(1, len(rows) // 10))
    return rows[: len(rows) - n_eval], rows[len(rows) - n_eval:]


def held_out_windows(tokenizer: Any, eval_rows: list[dict]) -> torch.Tensor:
    """The held-out rows' first user turns as 32-token prompt windows [K, 32], as training scores them."""
    from rasd.train.common import _prompt_of, prompt_windows

    return prompt_windows(tokenizer, [p for p in (_prompt_of(r) for r in eval_rows) if p], 32)


def _rows(data: str) -> list[dict]:
    """Conversations: a ShareGPT-style JSONL(.gz) (`builtin`: the shared ShareGPT, else offline prompts)."""
    from rasd.train.common import BUILTIN, SHAREGPT, _json_lines, load_prompts, shared_data

    path = shared_data() / SHAREGPT if data == BUILTIN else Path(data)
    if data == BUILTIN and not path.exists():
        return [{"conversations": [{"from": "human", "value": text}]} for text in load_prompts(BUILTIN)]
    if not path.exists():
        raise ValueError(f"data file {path} does not exist (or pass --data builtin)")
    rows = []
    for row in _json_lines(path):
        text = str(row.get("text") or row.get("prompt") or "")
        rows.append(row if row.get("conversations") else {"conversations": [{"from": "human", "value": text}]})
    return [r for r in rows if r.get("conversations")]


def _turns(text: str) -> tuple[int, ...]:
    """`--turns` as numbers; a one-line error for anything but positive integers."""
    try:
        turns = tuple(int(t) for t in str(text).split(",") if t.strip())
    except ValueError:
        turns = ()
    if not turns or min(turns) < 1:
        raise ValueError(f"--turns {text!r}: give user turn numbers from 1, comma separated (e.g. 1 or 1,2)")
    return turns


def run(config: EagleConfig) -> int:
    """`rasd train eagle`: check every setting before the data and the model are read, train, write the head and
    its report (the config it was trained with, then what training measured)."""
    from rasd.decoding.model.loading import ModelLoadError, load_model
    from rasd.errors import CliError
    from rasd.paths import eagle_path, rasd_home, slug
    from rasd.train.common import generation_cache

    try:
        check_config(config)
        rows = _rows(config.data)
        if len(rows) < 2:
            raise ValueError(f"{config.data}: need at least 2 conversations (one is held out)")
        rest, eval_rows = held_out_split(rows, config.eval_seqs)
        train_rows = rest[: config.seqs]
        target = load_model(config.model, device=config.device, dtype="float32")
        report, head = train_eagle(target, train_rows, eval_rows, config,
                                   rasd_home() / "eagle-features" / slug(config.model), generation_cache(config.model))
    except (ValueError, ModelLoadError) as exc:
        raise CliError(str(exc)) from exc
    out = config.out or eagle_path(config.model)
    save_head(out, head, report)
    write_json(out.with_suffix(".json"), report)
    print(f"rasd train eagle: wrote {out} ({out.stat().st_size / 1e6:.1f} MB); held-out top-1 agreement with the "
          f"target by depth {report['agreement']['top1']} (top-4 {report['agreement']['top4']}), draft vocabulary "
          f"{report['draft_vocab']}, {report['train_tokens']} training tokens, {report['train_s']:.0f} s training",
          file=sys.stderr)
    return 0


def check_config(config: EagleConfig) -> None:
    """One-line ValueErrors for settings `EagleConfig.validate` cannot judge alone (text options, pairs)."""
    config.validate()
    _turns(config.turns)
    _taps(config.taps)
    if not 0.0 <= config.temperature <= 10.0:
        raise ValueError(f"--temperature {config.temperature}: give a value from 0 (greedy) to 10")
    _check_samples(config.samples, config.temperature)
    _check_average(config.average_init, config.init)


def train_eagle(target: Any, train_rows: list[dict], eval_rows: list[dict], config: EagleConfig,
                features_dir: Path, selfgen: Path) -> tuple[dict[str, Any], EagleHead]:
    """Features (cached), draft vocabulary, training, held-out agreement; returns (report, head). The report is
    the config (`EagleConfig.record`) followed by what it resolved to and what training measured."""
    torch.manual_seed(config.seed)
    t0 = time.perf_counter()
    regen, turns, taps = config.regenerate, _turns(config.turns), _taps(config.taps)
    _check_taps(target.model, taps)
    folder = features_dir / model_fingerprint(target.model)
    if regen:
        data = regenerated_data(target, train_rows, regen, selfgen, turns=turns, gen_dtype=config.gen_dtype,
                                temperature=config.temperature, seed=config.seed, batch=config.gen_batch,
                                samples=config.samples, taps=taps, limit=config.max_answers)
    else:
        seqs = conversation_ids(target.tokenizer, train_rows, config.seq_len)
        data = extract_features(target.model, seqs, folder, taps=taps) if seqs else {"tokens": []}
    seqs = data["tokens"]
    if not seqs:
        raise ValueError("no training conversation has 32 tokens")
    features_s = time.perf_counter() - t0
    eos = set(target.eos_token_ids or ())
    vocab = draft_vocabulary(data["counts"], config.draft_vocab, eos)
    windows = held_out_windows(target.tokenizer, eval_rows)
    eval_seqs, eval_feats, eval_valid = held_out_set(target.model, windows, 48, eos, selfgen, taps=taps)
    head = _start_head(target.model, vocab, config.init, taps)
    before = depth_agreement(head.eval(), eval_seqs, eval_feats, eval_valid, windows.shape[1])
    weight = config.average_init
    parent = {k: v.detach().clone() for k, v in head.state_dict().items()} if weight is not None else None
    tokens = sum(len(s) for s in seqs)
    steps = config.steps if config.steps is not None else max(1, math.ceil(config.epochs * len(seqs) / config.batch))
    t1 = time.perf_counter()
    order_seed = config.batch_order_seed
    settings = [len(seqs), config.seq_len, regen, steps, config.batch, config.lr, config.noise, config.cls_weight,
                order_seed, config.draft_vocab] + ([config.ttt, str(config.init)] if config.ttt or config.init else [])
    settings += [list(taps)] if taps else []
    checkpoint = folder / f"checkpoint-{sequences_key(seqs, str(settings))}.pt"   # resumed only with the same settings
    final = train_head(head, data["tokens"], data["feats"], steps, config.batch, config.lr, config.noise,
                       config.cls_weight, order_seed, checkpoint=checkpoint, ttt=config.ttt)
    train_s = time.perf_counter() - t1
    trained = None
    if parent is not None:
        trained = depth_agreement(head, eval_seqs, eval_feats, eval_valid, windows.shape[1])
        average_weights(head, parent, weight)
    after = depth_agreement(head, eval_seqs, eval_feats, eval_valid, windows.shape[1])
    used = head.vocab   # with --init, the initial head's vocabulary, not the one this data's counts would pick
    covered = float(torch.isin(eval_seqs[:, windows.shape[1]:], used).float().mean()) if used is not None else 1.0
    resolved = {"steps": steps, "order_seed": order_seed, "turns": list(turns) if regen else None, "taps": list(taps),
                "draft_vocab": _out_rows(head)}   # with --init, the parent's vocabulary size
    measured = {"sequences": len(seqs), "train_tokens": tokens, "vocab_coverage": round(covered, 4),
                "agreement_trained": trained, "held_out_sequences": len(eval_seqs), "agreement_before": before,
                "agreement": after, "final_train": final, "features_s": round(features_s, 1),
                "train_s": round(train_s, 1), "torch_threads": torch.get_num_threads()}
    return {**config.record(), **resolved, **measured}, head


def average_weights(head: EagleHead, parent: dict[str, torch.Tensor], weight: float) -> None:
    """In place: the head's weights become `weight` x its own + (1 - weight) x `parent`'s (same keys)."""
    with torch.no_grad():
        for key, value in head.state_dict().items():
            if value.is_floating_point():
                value.copy_(weight * value + (1.0 - weight) * parent[key].to(value.dtype))


def _check_average(weight: float | None, init: Path | None) -> None:
    """`--average-init` needs a parent (`--init`) and a weight in (0, 1]."""
    if weight is None:
        return
    if init is None:
        raise ValueError("--average-init averages the trained head with its parent: give --init PARENT too")
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"--average-init {weight}: give the trained head's weight, above 0 and at most 1")


def _start_head(target: torch.nn.Module, vocab: torch.Tensor | None, init: Path | None,
                taps: tuple[int, ...] = ()) -> EagleHead:
    """A pass-through head over `vocab`, or `init`'s weights and draft vocabulary (continued training). With
    `taps` and a plain `init`, the fused head starts as `init` exactly (the tapped layers weigh zero)."""
    if init is None:
        return EagleHead(target, vocab, taps=taps)
    from rasd.decoding.model.eagle_head import load_head

    start = load_head(target, init).float()
    if start.taps == taps:
        return start.train()
    if start.taps:
        raise ValueError(f"--init {init} reads layers {list(start.taps)}; continue it with --taps "
                         f"{','.join(map(str, start.taps))}")
    head = EagleHead(target, start.vocab, taps=taps)
    missing, unexpected = head.load_state_dict(start.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("fc_taps") for k in missing), (missing, unexpected)
    return head.float().train()


def _taps(text: str) -> tuple[int, ...]:
    """`--taps 2,15` -> (2, 15); empty -> () (a plain head)."""
    try:
        taps = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--taps {text!r}: give target layer numbers, comma separated (e.g. 2,15)") from None
    if len(set(taps)) != len(taps) or any(t < 0 for t in taps):
        raise ValueError(f"--taps {text!r}: give distinct layer numbers from 0")
    return taps


def _check_taps(target: torch.nn.Module, taps: tuple[int, ...]) -> None:
    """Refuse layers the target does not have, before any data is written."""
    layers = len(target.get_decoder().layers)
    if any(t >= layers for t in taps):
        raise ValueError(f"--taps {','.join(map(str, taps))}: this model's layers are 0..{layers - 1}")


def _out_rows(head: EagleHead) -> int:
    """The head's output size (draft vocabulary rows)."""
    return head.config.vocab_size if head.vocab is None else len(head.vocab)
