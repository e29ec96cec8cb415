"""The target's own answers for head training, many at once, with the final-norm feature of every position.

Why not HF `generate`: at the batch sizes training data wants (hundreds of answers), its step is the dynamic
cache's concatenation and the grouped heads' `repeat_kv` copies, not the model (measured:
docs/lab-notes/drafters-and-training.md, "own answers"). Here every row has the
same prompt length (fixed windows), so one growable cache per layer (`GrowableLayer`, written in place) serves
the whole batch, the lean decoder layer (`fast_forward._layer`) attends to its filled part with the grouped heads
as they are, and the step is the products.

`dtype`: the answers may come from a half-precision copy of the target (bf16 runs on AMX / tensor cores several
times faster than fp32). Its greedy text is then its own, close to but not the fp32 target's, and so are
its features: training data, never a reference. Held-out agreement is always measured on the fp32 target.
`temperature` > 0 samples the answers (seeded): more distinct text from the same prompts.
"""

from __future__ import annotations

from typing import Any

import torch

from rasd.decoding.model import fast_forward
from rasd.decoding.model.features import layer_feature
from rasd.decoding.step.cache import GrowableLayer


@torch.inference_mode()
def answers_with_features(model: torch.nn.Module, windows: torch.Tensor, gen_tokens: int,
                          temperature: float = 0.0, generator: torch.Generator | None = None,
                          eos: list[int] | None = None, taps: tuple[int, ...] = ()
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Answers [K, P + G'] to `windows` [K, P] and the final-norm output [K, P + G' - 1, H] (fp16) of every
    position that was forwarded (the last token never is); with `taps`, those layers' outputs before it, as a
    fused head reads them ([.., (len(taps) + 1) H], `features.layer_feature`). Greedy, or sampled at
    `temperature`. Rows run in lockstep until every one has written an `eos` token (G' <= G); the caller cuts
    each after its first."""
    inner, head = model.get_decoder(), model.get_output_embeddings()
    param = next(model.parameters())
    k, p = windows.shape
    caches = [GrowableLayer() for _ in inner.layers]   # every row's keys/values in one buffer per layer
    ids = windows.to(param.device)
    out, feats = [ids.cpu()], []
    positions = torch.arange(p, device=param.device)[None]
    stops = torch.tensor(sorted(set(eos or ())), dtype=torch.long)
    done = torch.zeros(k, dtype=torch.bool)
    for step in range(gen_tokens):
        hidden, tapped = _forward(inner, caches, ids, positions, taps)
        normed = inner.norm(hidden)                                              # [K, T, H]
        feats.append(_stacked(tapped, normed))                                   # [K, T, (taps + 1) H]
        logits = head(normed[:, -1]).float()                                     # [K, V]
        ids = _next(logits, temperature, generator)[:, None]                     # [K, 1]
        out.append(ids.cpu())
        done |= torch.isin(out[-1][:, 0], stops)
        if bool(done.all()):
            break
        positions = torch.tensor([[p + step]], device=param.device)
    return torch.cat(out, dim=1), torch.cat(feats, dim=1)


@torch.inference_mode()
def teacher_features(model: torch.nn.Module, sequences: list[list[int]], taps: tuple[int, ...] = (),
                     batch: int = 32) -> list[torch.Tensor]:
    """Each sequence's features [n_i, (len(taps) + 1) H] (fp16), as `answers_with_features` records them while
    writing it, from one causal forward per `batch` rows (right-padded: a row's padding comes after every
    position it keeps, so it changes none of them).

    Why: a fused head trained on answers already cached without taps gets its layers from this one pass over
    the text (≈ a third of what writing the answers again costs), not from a second generation."""
    inner = model.get_decoder()
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for s in range(0, len(sequences), batch):
        part = sequences[s: s + batch]
        width = max(len(q) for q in part)
        ids = torch.tensor([q + [0] * (width - len(q)) for q in part], device=device)    # [B, L]
        caches = [GrowableLayer() for _ in inner.layers]
        hidden, tapped = _forward(inner, caches, ids, torch.arange(width, device=device)[None], taps)
        feats = _stacked(tapped, inner.norm(hidden))                             # [B, L, (taps + 1) H]
        out += [feats[i, : len(q)].clone() for i, q in enumerate(part)]
    return out


def _stacked(tapped: list[torch.Tensor], normed: torch.Tensor) -> torch.Tensor:
    """The features a head is trained on, fp16 on the CPU: the tapped layers in order, then the final-norm output
    (the layout `features.FinalNormTap.stacked` hands a head in decoding)."""
    return torch.cat([*tapped, normed], dim=-1).to(torch.float16).cpu()


def _forward(inner: Any, caches: list[GrowableLayer], ids: torch.Tensor, positions: torch.Tensor,
             taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Hidden states [K, T, H] after the last layer, and the tapped layers' features [K, T, H] in `taps` order;
    T > 1 only for the prompt (causal, empty cache)."""
    hidden = torch.nn.functional.embedding(ids, inner.embed_tokens.weight)
    cos, sin = inner.rotary_emb.forward(hidden, positions)
    causal = ids.shape[1] > 1
    kept: dict[int, torch.Tensor] = {}
    for i, (layer, kv) in enumerate(zip(inner.layers, caches, strict=True)):
        hidden = fast_forward._layer(layer, kv, hidden, cos[:, None], sin[:, None], None, causal, 0)
        if i in taps:
            kept[i] = layer_feature(hidden)
    return hidden, [kept[i] for i in taps]


_BLOCK = 1024   # vocabulary entries per block of `_draw`


def _next(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """[K] next tokens: argmax, or drawn from softmax(logits / temperature)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return _draw(torch.softmax(logits / temperature, dim=-1), generator)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[K] one index per row of probs [K, V], by inverse CDF in two levels (blocks, then within the block).

    Why not `torch.multinomial`: on CPU it takes about as long as the step's forward at training batch sizes
    (docs/lab-notes/drafters-and-training.md, "own answers"); the block sums here are one parallel reduction
    and the per-row work is 2 x 1024 entries."""
    k, v = probs.shape
    padded = probs if v % _BLOCK == 0 else torch.nn.functional.pad(probs, (0, (-v) % _BLOCK))
    blocks = padded.view(k, -1, _BLOCK)                                                # [K, nb, B]
    ends = blocks.sum(-1).double().cumsum(-1)                                          # [K, nb]
    u = torch.rand(k, 1, generator=generator, dtype=torch.float64, device=probs.device) * ends[:, -1:]
    block = torch.searchsorted(ends, u).clamp_(max=ends.shape[1] - 1)                 # [K, 1]
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(u))
    inside = blocks[torch.arange(k, device=probs.device), block[:, 0]].double().cumsum(-1)   # [K, B]
    offset = torch.searchsorted(inside, u - before).clamp_(max=_BLOCK - 1)
    return (block * _BLOCK + offset)[:, 0].clamp_(max=v - 1)
