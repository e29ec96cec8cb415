"""`rasd train ldlp`: AdaEAGLE's Lightweight Draft Length Predictor (arXiv 2412.18910) for one drafter.

The target greedily continues prompt windows; one teacher-forced target forward gives the final-norm hidden
state at every position (the same `FinalNormTap` decoding uses) and one drafter forward gives the drafter's
argmax after every prefix. The label of root position i is the length of the common prefix of the drafter's
k_max-token greedy continuation and the target's own (`ldlp.ldlp_labels`: one forward labels every
position). The EAGLE head (`--drafter eagle`, AdaEAGLE's own drafter) reads its own predicted features past
depth 1, so its chains are rolled out level by level for all roots at once (`train.eagle.head_chain_labels`).
Features: concat(the target's input embedding of token i, the final-norm hidden state at i - 1).
Loss: L1 weighted by λ (default 2) where the prediction is too short: a too-short draft forfeits tokens that
would have been accepted, a too-long one only costs draft time (DDD also extends confident drafts).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from rasd import paths
from rasd.decoding.model.eagle_head import EagleHead
from rasd.decoding.sizing.ldlp import LengthPredictor, ldlp_features, ldlp_labels, weighted_l1
from rasd.train.common import self_generate, split, write_json
from rasd.train.config import LdlpConfig


@torch.no_grad()
def ldlp_dataset(target: torch.nn.Module, drafter: torch.nn.Module, prompts: torch.Tensor, k_max: int,
                 gen_tokens: int, eos_ids: set[int] | None = None, batch: int = 16, cache: Path | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [M, 2H] float32, labels [M] float32, sequence index [M]) over the generated positions.

    A root position i is used when the text is real (before EOS) up to i + k_max, so labels are never cut
    short by the end of the text.
    """
    data = self_generate(target, prompts, gen_tokens, batch=batch, final=True, eos_ids=eos_ids, top=1,
                         cache=cache)
    embed = target.get_input_embeddings()
    device = next(target.parameters()).device
    feats, labels, seqs = [], [], []
    p = data.prompt_len
    for s in tqdm(range(0, len(data.tokens), batch), desc="labelling", unit="batch"):
        tokens = data.tokens[s: s + batch]
        labels_of = _labeller(drafter, tokens, data.final_hidden[s: s + batch], k_max, device)
        emb = embed(tokens.to(device)).float().cpu()                          # [B, T, H]
        for b in range(len(tokens)):
            lab = labels_of(b)                                                # [T - 1], root i -> lab[i]
            n_valid = int(data.valid[s + b].sum())
            roots = [i for i in range(p, len(tokens[b]) - 1) if i + k_max < n_valid]
            if not roots:
                continue
            idx = torch.tensor(roots)
            feats.append(ldlp_features(emb[b, idx], data.final_hidden[s + b, idx - 1]))
            labels.append(lab[idx].float())
            seqs.append(torch.full((len(roots),), s + b))
    if not feats:
        raise ValueError("no usable positions: generate more tokens (--gen-tokens) or lower --k-max")
    return torch.cat(feats), torch.cat(labels), torch.cat(seqs)


def _labeller(drafter: torch.nn.Module, tokens: torch.Tensor, final_hidden: torch.Tensor, k_max: int,
              device: torch.device) -> Callable[[int], torch.Tensor]:
    """Row b -> its labels [T - 1] (root i -> label i). A draft LM: one forward over the text labels every
    root (`ldlp_labels`). The EAGLE head drafts on its own features past depth 1, so each root's chain is
    rolled out as decoding drafts it (`train.eagle.head_chain_labels`); roots too close to the end get 0 (the
    caller never uses them)."""
    if isinstance(drafter, EagleHead):
        from rasd.train.eagle_head import head_chain_labels

        t = tokens.shape[1]
        roots = torch.arange(1, t - k_max)
        feats = final_hidden.to(device, next(drafter.parameters()).dtype)
        rows = head_chain_labels(drafter, tokens.to(device), feats, roots.to(device), k_max).cpu()   # [B, R]
        full = torch.zeros(len(tokens), t - 1, dtype=torch.long)
        full[:, roots] = rows
        return lambda b: full[b]
    argmax = drafter(tokens.to(device)).logits.argmax(-1).cpu()              # [B, T]
    return lambda b: ldlp_labels(argmax[b], tokens[b], k_max)


def evaluate(model: LengthPredictor, feats: torch.Tensor, labels: torch.Tensor, under_weight: float) -> dict:
    with torch.no_grad():
        pred = model(feats)
        k = pred.round().clamp(0, model.k_max)
    return {"weighted_l1": float(weighted_l1(pred, labels, under_weight)), "mae": float((k - labels).abs().mean()),
            "exact": float((k == labels).float().mean()), "under": float((k < labels).float().mean()),
            "mean_label": float(labels.mean()), "mean_k": float(k.mean())}


def train_ldlp(target: torch.nn.Module, drafter: torch.nn.Module, prompts: torch.Tensor, k_max: int = 8,
               gen_tokens: int = 48, steps: int = 2000, batch: int = 256, lr: float = 1e-3,
               under_weight: float = 2.0, width: int = 256, held_out: float = 0.1,
               eos_ids: set[int] | None = None, seed: int = 0, cache: Path | None = None,
               ) -> tuple[LengthPredictor, dict[str, Any]]:
    """Label the target's own continuations with `drafter` and fit the LDLP; (predictor, report)."""
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    feats, labels, seqs = ldlp_dataset(target, drafter, prompts, k_max, gen_tokens, eos_ids, cache=cache)
    data_s = time.perf_counter() - t0
    train_seqs, test_seqs = split(int(seqs.max()) + 1, held_out, seed)
    test = torch.isin(seqs, test_seqs) if len(test_seqs) else torch.zeros_like(seqs, dtype=torch.bool)
    if test.all() or not test.any():
        test = torch.ones_like(test)
    train = ~test if (~test).any() else test
    x, y = feats[train], labels[train]
    mean, std = x.mean(0), x.std(0).clamp(min=1e-4)
    model = LengthPredictor(feats.shape[1] // 2, width=width, k_max=k_max)
    with torch.no_grad():   # start from the mean label; inputs are standardised during training only
        model.out.bias.fill_(float(y.mean()))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    xs = (x - mean) / std
    t1 = time.perf_counter()
    bar = tqdm(range(steps), desc="training LDLP", unit="step")
    for _ in bar:
        idx = torch.randint(len(xs), (min(batch, len(xs)),), generator=gen)
        loss = weighted_l1(model(xs[idx]), y[idx], under_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    with torch.no_grad():   # fold the standardisation into the input layer: W (x - m) / s + b
        w = model.inp.weight / std
        model.inp.bias -= (w * mean).sum(1)
        model.inp.weight.copy_(w)
    model.eval()
    report = {"k_max": k_max, "under_weight": under_weight, "width": width, "steps": steps,
              "positions": len(labels), "train_positions": int(train.sum()), "held_out_positions": int(test.sum()),
              "held_out": evaluate(model, feats[test], labels[test], under_weight),
              "constant_mae": float((labels[test] - labels[train].median()).abs().mean()),
              "data_s": round(data_s, 1), "train_s": round(time.perf_counter() - t1, 1)}
    return model, report


def add_parser(sub: Any) -> None:
    LdlpConfig.add_parser(sub, run)


def run(config: LdlpConfig) -> int:
    """`rasd train ldlp`: check the settings before the data and the models are read, label and train, write the
    predictor and its report (the config it was trained with, then what training measured)."""
    from rasd.decoding.model.eagle_head import load_head
    from rasd.decoding.model.loading import ModelLoadError, load_model
    from rasd.decoding.proposers.early_exit import load_early_exit
    from rasd.errors import CliError
    from rasd.train.common import generation_cache, load_prompts, prompt_windows

    try:
        config.validate()
        prompts = load_prompts(config.data, config.seqs * 3)
        target = load_model(config.model, device=config.device, dtype="float32")
        if config.drafter == "eagle":
            drafter = load_head(target.model, config.eagle, config.model)
        elif config.drafter == "eesd":
            drafter = load_early_exit(target.model, config.eesd, config.model)
        else:
            drafter = load_model(config.drafter, device=config.device, dtype="float32").model
        windows = prompt_windows(target.tokenizer, prompts, config.prompt_tokens)[: config.seqs]
        model, report = train_ldlp(target.model, drafter, windows, config.k_max, config.gen_tokens, config.steps,
                                   under_weight=config.under_weight, eos_ids=target.eos_token_ids, seed=config.seed,
                                   cache=generation_cache(config.model))
    except (ValueError, ModelLoadError) as exc:
        raise CliError(str(exc)) from exc
    drafter_tag = config.drafter if config.drafter in ("eagle", "eesd") else "draft-model"
    out = config.out or paths.ldlp_path(config.model, drafter_tag)
    report = {**config.record(), **report}
    model.save(out, {"model": config.model, "drafter": config.drafter})
    write_json(out.with_suffix(".json"), report)
    held = report["held_out"]
    print(f"rasd train ldlp: wrote {out}; held-out MAE {held['mae']:.2f} tokens (constant predictor "
          f"{report['constant_mae']:.2f}), exact k {held['exact']:.2f}, mean label {held['mean_label']:.2f}",
          file=sys.stderr)
    return 0
