"""`rasd train eesd`: self-distil EESD's exit layer (arXiv 2406.03853) on the target's own generations.

The target greedily continues prompt windows from a data file (`builtin`: first user turns of ShareGPT
when ../shared/data is there, else requests about CPython's language reference, offline); the continuations
are cached under $RASD_HOME/selfgen/ (re-training with other settings skips generation). One teacher-forced
forward gives, at every position, the input of layer N (the draft's first N layers ARE the target's, so it
is stored once) and the target's next-token log-probs (top-32 kept). Only the exit layer (initialised from
target layer N) is trained: it reads the stored layer-N input, then the target's frozen final norm and LM
head give the draft's log-probs, and the loss is the cross-entropy to the target's distribution over its
top-32 tokens plus one bucket for the rest (= KL up to the target's entropy), on the generated positions.
With a draft vocabulary (`--draft-vocab`, default 8192: the tokens the target most often writes) the head
and the loss are over that vocabulary. Held-out sequences give the top-1 agreement with the target.

Defaults (1,600 prompts, 32-token prompt windows, 48 new tokens each, 4 epochs of batches of 8, AdamW at
3e-3 with a cosine decay) take about 15 minutes on a 2-core CPU with SmolLM2-135M, where generation
dominates (~35 s per 64 sequences; training ~0.2 s a step). Measured there: more epochs over-fit (train
agreement 0.65 against 0.38 held out), so more sequences, not more steps, is what would help.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rasd.decoding.proposers.early_exit import (
    decoder_layers,
    default_layers,
    eesd_path,
    new_exit_layer,
    save_exit_layer,
)
from rasd.train.common import SelfGenerated, generation_cache, self_generate, split, write_json
from rasd.train.config import EesdConfig


def distill_loss(student_logits: torch.Tensor, teacher_logp: torch.Tensor, teacher_ids: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the teacher's top-k distribution plus a tail bucket, averaged over `mask`.

    student_logits [B, G, V']; teacher_logp / teacher_ids [B, G, k] with ids indexing the student's V'
    outputs, -1 for a teacher token the student cannot output (its mass goes to the tail); mask [B, G] bool.
    """
    logq = student_logits.float().log_softmax(-1)
    inside = teacher_ids >= 0
    q_top = logq.gather(-1, teacher_ids.long().clamp(min=0))            # [B, G, k]
    p_top = teacher_logp.float().exp() * inside
    p_tail = (1.0 - p_top.sum(-1)).clamp(min=0.0)
    q_tail = torch.log1p(-(q_top.exp() * inside).sum(-1).clamp(max=1.0 - 1e-6))
    ce = -(p_top * q_top).sum(-1) - p_tail * q_tail                     # [B, G]
    return (ce * mask).sum() / mask.sum().clamp(min=1)


def exit_logits(target: torch.nn.Module, exit_layer: torch.nn.Module, hidden: torch.Tensor,
                first: int, head: torch.Tensor | None = None) -> torch.Tensor:
    """Draft logits [B, T - first - 1, V'] at positions first .. T-2 from layer-N inputs hidden [B, T, H].

    The final norm and LM head are the target's, applied with detached weights (frozen, no weight grads);
    `head` [V', H] restricts the head to the draft vocabulary's rows.
    """
    pos = torch.arange(hidden.shape[1], device=hidden.device)[None]
    rope = target.get_decoder().rotary_emb(hidden, pos)
    h = exit_layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=rope)
    h = h[:, first:-1]
    norm = target.get_decoder().norm
    h = F.rms_norm(h, (h.shape[-1],), norm.weight.detach(), norm.variance_epsilon)
    return F.linear(h, target.get_output_embeddings().weight.detach() if head is None else head)


def targets(data: SelfGenerated) -> torch.Tensor:
    """[K, G] bool: positions P-1 .. T-2 whose next token is a real generated token (not after EOS)."""
    return data.valid[:, data.prompt_len:]


def draft_vocabulary(data: SelfGenerated, rows: torch.Tensor, size: int, vocab: int,
                     always: set[int] | None = None) -> torch.Tensor | None:
    """The `size` tokens the target most often writes (FR-Spec-style), sorted; None = the whole vocabulary.

    Frequency is the target's expected count: its top-k probabilities summed over the generated positions
    of `rows` (smoother than counting the greedy tokens of a few thousand sequences), plus the prompts'
    tokens. `always` (EOS) is kept whatever its count.
    """
    if size <= 0 or size >= vocab:
        return None
    mask = targets(data)[rows].unsqueeze(-1)                           # [R, G, 1]
    ids = data.teacher_ids[rows].long()
    mass = data.teacher_logp[rows].float().exp() * mask
    counts = torch.zeros(vocab).index_add_(0, ids.reshape(-1), mass.reshape(-1))
    counts += torch.bincount(data.tokens[rows, : data.prompt_len].reshape(-1), minlength=vocab)[:vocab] * 0.1
    for tok in always or ():
        if 0 <= tok < vocab:
            counts[tok] = float("inf")
    return counts.topk(size).indices.sort().values


def to_draft_ids(ids: torch.Tensor, vocab: torch.Tensor | None, full: int) -> torch.Tensor:
    """Target token ids -> indices into the draft vocabulary (-1 outside it); identity without one."""
    if vocab is None:
        return ids.long()
    index = torch.full((full,), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return index[ids.long()]


@torch.no_grad()
def agreement(target: torch.nn.Module, exit_layer: torch.nn.Module, data: SelfGenerated, rows: torch.Tensor,
              batch: int = 8, vocab: torch.Tensor | None = None) -> float:
    """Top-1 agreement of the draft with the target (its greedy token) on `rows`' generated positions."""
    head = _head(target, vocab)
    hits = total = 0
    for s in range(0, len(rows), batch):
        idx = rows[s: s + batch]
        logits = exit_logits(target, exit_layer, data.layer_hidden[idx].float(), data.prompt_len - 1, head)
        guess = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]
        mask = targets(data)[idx]
        hits += int(((guess == data.teacher_ids[idx][..., 0].long()) & mask).sum())
        total += int(mask.sum())
    return hits / max(total, 1)


def coverage(data: SelfGenerated, rows: torch.Tensor, vocab: torch.Tensor | None) -> float:
    """Fraction of the target's greedy tokens on `rows` that the draft vocabulary holds (the agreement cap)."""
    if vocab is None:
        return 1.0
    mask = targets(data)[rows]
    inside = torch.isin(data.teacher_ids[rows][..., 0].long(), vocab) & mask
    return float(inside.sum()) / max(int(mask.sum()), 1)


def _head(target: torch.nn.Module, vocab: torch.Tensor | None) -> torch.Tensor | None:
    return None if vocab is None else target.get_output_embeddings().weight.detach()[vocab]


def train_eesd(target: torch.nn.Module, prompts: torch.Tensor, layers: int | None = None, gen_tokens: int = 48,
               steps: int | None = None, batch: int = 8, lr: float = 3e-3, held_out: float = 0.1,
               eos_ids: set[int] | None = None, seed: int = 0, draft_vocab: int = 0, cache: Path | None = None,
               ) -> tuple[torch.nn.Module, torch.Tensor | None, dict[str, Any]]:
    """Train an exit layer for `target` on its own continuations of `prompts` [K, P].

    Returns (layer, draft vocabulary or None, report). `draft_vocab` > 0 restricts the draft's head to the
    target's most written tokens; the loss is then over that vocabulary (+ the tail bucket).
    """
    n_layers = len(decoder_layers(target))
    layers = default_layers(n_layers) if layers is None else layers
    if not 0 < layers < n_layers:
        raise ValueError(f"--layers must be between 1 and {n_layers - 1} for this model")
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    data = self_generate(target, prompts, gen_tokens, layer=layers, eos_ids=eos_ids, cache=cache)
    gen_s = time.perf_counter() - t0
    train_rows, test_rows = split(len(data.tokens), held_out, seed)
    if len(test_rows) == 0:
        test_rows = train_rows
    full = target.get_output_embeddings().weight.shape[0]
    vocab = draft_vocabulary(data, train_rows, draft_vocab, full, eos_ids)
    head = _head(target, vocab)
    teacher_ids = to_draft_ids(data.teacher_ids, vocab, full)             # [K, G, k] in draft indices
    exit_layer = new_exit_layer(target, layers).train()
    exit_layer.requires_grad_(True)
    before = agreement(target, exit_layer.eval(), data, test_rows, vocab=vocab)
    exit_layer.train()
    steps = steps if steps is not None else max(1, math.ceil(4 * len(train_rows) / batch))
    opt = torch.optim.AdamW(exit_layer.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    t1 = time.perf_counter()
    bar = tqdm(range(steps), desc="training exit layer", unit="step")
    for step in bar:
        idx = train_rows[torch.randint(len(train_rows), (min(batch, len(train_rows)),), generator=gen)]
        logits = exit_logits(target, exit_layer, data.layer_hidden[idx].float(), data.prompt_len - 1, head)
        loss = distill_loss(logits, data.teacher_logp[idx], teacher_ids[idx], targets(data)[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(exit_layer.parameters(), 1.0)
        for group in opt.param_groups:   # short linear warm-up, then cosine decay to a tenth
            group["lr"] = lr * min(1.0, (step + 1) / 10) * (0.55 + 0.45 * math.cos(math.pi * step / steps))
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    exit_layer.eval()
    after = agreement(target, exit_layer, data, test_rows, vocab=vocab)
    report = {"layers": layers, "num_hidden_layers": n_layers, "sequences": len(data.tokens),
              "held_out_sequences": len(test_rows), "prompt_tokens": data.prompt_len, "gen_tokens": gen_tokens,
              "steps": steps, "batch": batch, "lr": lr, "final_loss": sum(losses[-20:]) / max(len(losses[-20:]), 1),
              "draft_vocab": full if vocab is None else len(vocab),
              "vocab_coverage": coverage(data, test_rows, vocab),
              "agreement_before": before, "agreement": after, "generate_s": round(gen_s, 1),
              "train_s": round(time.perf_counter() - t1, 1)}
    return exit_layer, vocab, report


def add_parser(sub: Any) -> None:
    EesdConfig.add_parser(sub, run)


def run(config: EesdConfig) -> int:
    """`rasd train eesd`: check the settings before the data and the model are read, train, write the exit layer
    and its report (the config it was trained with, then what training resolved and measured)."""
    from rasd.decoding.model.loading import ModelLoadError, load_model
    from rasd.errors import CliError
    from rasd.train.common import load_prompts, prompt_windows

    try:
        config.validate()
        prompts = load_prompts(config.data, config.seqs * 3)
        target = load_model(config.model, device=config.device, dtype="float32")
        windows = prompt_windows(target.tokenizer, prompts, config.prompt_tokens)[: config.seqs]
        layer, vocab, report = train_eesd(target.model, windows, config.layers, config.gen_tokens, config.steps,
                                          config.batch, config.lr, eos_ids=target.eos_token_ids, seed=config.seed,
                                          draft_vocab=config.draft_vocab, cache=generation_cache(config.model))
    except (ValueError, ModelLoadError) as exc:
        raise CliError(str(exc)) from exc
    out = config.out or eesd_path(config.model)
    report = {**config.record(), **report}
    save_exit_layer(out, layer, report["layers"], {"model": config.model}, vocab=vocab)
    write_json(out.with_suffix(".json"), report)
    print(f"rasd train eesd: wrote {out} ({out.stat().st_size / 1e6:.1f} MB); held-out top-1 agreement with the "
          f"target {report['agreement']:.3f} (before training {report['agreement_before']:.3f}; N={report['layers']}"
          f", draft vocabulary {report['draft_vocab']} covering {report['vocab_coverage']:.3f} of the target's tokens, "
          f"{report['sequences']} sequences, {report['steps']} steps)", file=sys.stderr)
    return 0
