"""AdaEAGLE's Lightweight Draft Length Predictor (LDLP) and the DDD stopping rule (arXiv 2412.18910).

Input: concat(the target's input embedding of the root token (the token just committed, which the next draft
continues), the target's final-norm hidden state at the position before it (the last verified position,
whose logits produced the root)), the EAGLE pairing (feature f_t, token x_{t+1}). A 3-layer residual MLP
maps it to one scalar; k = clamp(round(.), 0, k_max).

AdaEAGLE-DDD: draft a chain and stop only when step >= k AND the cumulative draft log-probability of the
chain is below -0.6 (hard cap k_max). The stop decision after token s looks only at tokens 1..s, never at
the token it would add, so sampled drafts stay draws from q and exact sampling is kept.

The hidden state comes from `FinalNormTap`: a forward hook on the target's final norm that keeps a reference
to the norm's output (no copy, no `output_hidden_states`): the normal decoding path is unchanged and the
hook is only installed when an LDLP is used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rasd import paths
from rasd.decoding.model.features import FinalNormTap, final_norm, shared_tap  # noqa: F401 - re-exported
from rasd.decoding.sizing.protocol import SizerDefaults
from rasd.decoding.step.tree import DraftTree

LOG_THRESHOLD = -0.6
FORMAT = "rasd-ldlp-1"


class LengthPredictor(nn.Module):
    """in [.., 2H] -> Linear -> 3 residual blocks (x + W2 SiLU(W1 x)) -> Linear -> [..] (a real number)."""

    def __init__(self, hidden_size: int, width: int = 256, blocks: int = 3, k_max: int = 8):
        super().__init__()
        self.hidden_size, self.width, self.k_max = hidden_size, width, k_max
        self.inp = nn.Linear(2 * hidden_size, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
                                    for _ in range(blocks))
        self.out = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.inp(features)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)

    def length(self, features: torch.Tensor) -> int:
        """k = clamp(round(prediction), 0, k_max) for one feature vector [2H]."""
        return int(min(max(round(float(self(features))), 0), self.k_max))

    def save(self, path: Path, extra: dict[str, Any] | None = None) -> None:
        from safetensors.torch import save_file

        meta = {"format": FORMAT, "hidden_size": self.hidden_size, "width": self.width,
                "blocks": len(self.blocks), "k_max": self.k_max}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(tmp),
                  metadata={"rasd": json.dumps({**meta, **(extra or {})})})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path | str) -> LengthPredictor:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("rasd", "{}"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an LDLP file written by `rasd train ldlp`")
        model = cls(meta["hidden_size"], meta["width"], meta["blocks"], meta["k_max"])
        model.load_state_dict(load_file(str(path)))
        return model.eval()


def ldlp_features(embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """concat(input embedding of the root token, final-norm hidden state before it) [.., 2H], float32."""
    return torch.cat([embedding.float(), hidden.float()], dim=-1)


def weighted_l1(pred: torch.Tensor, target: torch.Tensor, under_weight: float = 2.0) -> torch.Tensor:
    """Mean |pred - target|, weighted by `under_weight` (> 1) where pred < target (under-prediction)."""
    weight = torch.where(pred < target, torch.full_like(pred, under_weight), torch.ones_like(pred))
    return (weight * (pred - target).abs()).mean()


def ldlp_labels(draft_argmax: torch.Tensor, tokens: torch.Tensor, k_max: int) -> torch.Tensor:
    """Common-prefix length of the drafter's greedy k_max continuation and the text, at every position.

    draft_argmax [T]: the drafter's argmax after tokens[: j + 1]; tokens [T]. While the drafter's tokens match
    the text its context *is* the text, so its continuation after position i matches for exactly as many
    steps as `draft_argmax[j] == tokens[j + 1]` holds for j = i, i + 1, ...: one drafter forward over the
    sequence labels every position. Returns [T - 1] (label of position i = root tokens[i]), capped at k_max
    and by the end of the text.
    """
    match = (draft_argmax[:-1] == tokens[1:]).long()   # [T - 1]
    out = torch.zeros_like(match)
    run = 0
    for i in range(match.numel() - 1, -1, -1):
        run = run + 1 if match[i] else 0
        out[i] = min(run, k_max)
    return out


def ddd_stop(step: int, cum_logprob: float, k: int, log_threshold: float = LOG_THRESHOLD) -> bool:
    """AdaEAGLE-DDD: after `step` drafted tokens, stop only if step >= k and the chain's log-prob < threshold."""
    return step >= k and cum_logprob < log_threshold


class LDLPController:
    """Predicts k from the target's state after the last verification; applies DDD while drafting.

    `observe` must run right after the verification forward (proposer.observe / sizer.observe do): it takes
    the hidden state of the last accepted node from the tap. Before the first verification of a request the
    tap holds the prefill, whose last position is the one before the root.
    """

    def __init__(self, target: nn.Module, predictor: LengthPredictor, log_threshold: float = LOG_THRESHOLD):
        self.predictor = predictor.to(next(target.parameters()).device)
        self.embed = target.get_input_embeddings()
        self.tap = shared_tap(target)
        self.k_max, self.log_threshold = predictor.k_max, log_threshold
        self.k = 0
        self._hidden: torch.Tensor | None = None
        self._unknown = False

    @property
    def max_depth(self) -> int:
        return self.k_max

    def start(self) -> None:
        self._hidden = None
        self._unknown = False

    @torch.inference_mode()
    def predict(self, root_token: int) -> int:
        hidden = self._hidden
        if hidden is None:
            if self.tap.last is None or self._unknown:
                self.k = self.k_max
                return self.k
            hidden = self._final(self.tap.last[0, -1])
        emb = self.embed(torch.tensor([root_token], device=hidden.device))[0]
        self.k = self.predictor.length(ldlp_features(emb, hidden))
        return self.k

    def _final(self, features: torch.Tensor) -> torch.Tensor:
        """The final-norm part [H] of the tap's features (a fused head's tap holds tapped layers before it)."""
        return features[..., -self.predictor.hidden_size:]

    def limit(self, context: list[int]) -> int:
        """Most tokens to draft this step (k is predicted here; DDD may stop earlier, never before k)."""
        self.predict(context[-1])
        return self.k_max

    def stop(self, step: int, cum_logprob: float) -> bool:
        return ddd_stop(step, cum_logprob, self.k, self.log_threshold)

    def observe(self, tree: DraftTree, accepted: list[int]) -> None:
        """Keep the hidden state of the last accepted node (the tap holds the verification forward)."""
        last = self.tap.last
        if last is not None and last.shape[0] == 1 and last.shape[1] == len(tree):
            self._hidden = self._final(last[0, accepted[-1] if accepted else 0])
        else:   # not a single-request tree forward (e.g. a batched verifier): predict nothing, DDD alone decides
            self._hidden = None
            self._unknown = True

    def cut(self, tree: DraftTree) -> DraftTree:
        """Apply k and DDD to any proposed tree: a node stays while no ancestor's step would have stopped."""
        self.predict(tree.tokens[0])
        depths = tree.depths()
        keep, stopped = [], [False] * len(tree)
        for i in range(1, len(tree)):
            parent = tree.parents[i]
            score = tree.scores[parent] if parent > 0 else 1.0
            stopped[i] = stopped[parent] or ddd_stop(depths[parent], math.log(max(score, 1e-30)), self.k,
                                                     self.log_threshold)
            if not stopped[i] and depths[i] <= self.k_max:
                keep.append(i)
        return tree.subtree(keep)


def ldlp_path(model_name: str, drafter: str) -> Path:
    """Where the LDLP for a model and drafter is read: the one trained here ($RASD_HOME/ldlp/<model>--<drafter>
    .safetensors, where `rasd train ldlp` writes), else the one shipped beside the embedded model's EAGLE head
    (`adaeagle` runs with no training step), else the trained location (named by the error that follows)."""
    trained = paths.ldlp_path(model_name, drafter)
    if trained.exists():
        return trained
    shipped = shipped_ldlp_path(model_name, drafter)
    return shipped if shipped.exists() else trained


def shipped_ldlp_path(model_name: str, drafter: str) -> Path:
    """The LDLP shipped in the package for an embedded model's drafter: `heads/<model>--<drafter>-ldlp.safetensors`."""
    from rasd.decoding.model.eagle_head import shipped_path

    head = shipped_path(model_name)
    return head.with_name(f"{head.stem}--{paths.slug(drafter)}-ldlp.safetensors")


def load_controller(target: nn.Module, path: Path | str | None, model_name: str, drafter: str) -> LDLPController:
    """An LDLPController from `path` (or the default location); a one-line error when it is missing."""
    file = Path(path) if path else ldlp_path(model_name, drafter)
    if not file.exists():
        raise ValueError(f"no trained LDLP at {file}: run `rasd train ldlp --model {model_name} --drafter "
                         f"{drafter}` (or pass --ldlp PATH)")
    return LDLPController(target, LengthPredictor.load(file))


class LDLPSizer(SizerDefaults):
    """AdaEAGLE's LDLP + DDD as a cut on any proposed tree (the decision logic lives in `LDLPController`).

    A sampled node is decided by its ancestors' scores only (DDD's stop after a token never looks at the
    next one), so sampled chains stay exact. Nothing to carry (`state()` is {}): the predictor is trained
    offline, and what the controller keeps between steps (the last accepted position's hidden state) belongs
    to one request.
    """

    def __init__(self, controller: LDLPController, max_nodes: int = 64):
        self.controller, self.max_nodes = controller, max_nodes

    def budget(self, context_len: int) -> int:
        return self.max_nodes

    def cut(self, tree: DraftTree, context_len: int) -> DraftTree:
        return self.controller.cut(tree).top_nodes(self.max_nodes)

    def observe(self, tree: DraftTree, accepted: list[int], overhead_s: float,
                verify_s: float | None = None) -> None:
        """Take the hidden state of the last accepted node for the next prediction."""
        self.controller.observe(tree, accepted)
