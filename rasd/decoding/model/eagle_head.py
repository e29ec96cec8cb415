"""EAGLE's feature-level draft head (arXiv 2401.15077, 2406.16858) for a target model.

The head drafts in the target's feature space: from the target's final-norm hidden state f_t (what its LM head
reads) and the embedding of the next token x_{t+1}, it predicts f_{t+1}; the target's own LM head turns that
into a distribution over x_{t+2}. Layout:

    fc:    Linear([embed(x_{t+1}); f_t]) [.., 2H] -> [.., H]
    layer: one decoder layer of the target's architecture (its own weights, its own small KV cache)
    head:  the target's LM head (restricted to a draft vocabulary when one was trained: `SubsetHead`)

With `taps` (EAGLE-3's fused features) the context features are the outputs of those target layers, each
RMS-normalised, beside f_t: [.., (len(taps) + 1) H] (`features.FinalNormTap` keeps them from the verification
forward); the head reads f_t + fc_taps(tapped layers), with `fc_taps` starting at zero, so a fused head begins
exactly as a plain one (a residual: a map over all of [taps; f_t] that starts as the identity on f_t is the same
function, but its identity block trained too, and continuing a trained head it set the head back further).
A draft node's own predicted feature is [.., H] and skips it.

The target's embedding, rotary tables and LM head are shared, not copied: the file holds `fc`, the layer and
the draft vocabulary (token ids). The target's features of accepted tokens come from the verification forward
that already ran (the engine hands them over); the head never runs the target.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rasd import paths
from rasd.decoding.model import fast_forward, kernels
from rasd.decoding.model.target import TargetModel

FORMAT = "rasd-eagle-1"
VOCAB_KEY = "draft_vocab"
HEADS_DIR = Path(__file__).with_name("heads")   # heads shipped inside the package, one per embedded model


@dataclass(frozen=True)
class HeadConfig:
    """What a head must share with its target; a mismatch is refused before any weight is read."""

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int          # rows of the target's LM head

    @classmethod
    def of(cls, target: nn.Module) -> HeadConfig:
        cfg = target.config
        heads = int(cfg.num_attention_heads)
        return cls(model_type=str(cfg.model_type), hidden_size=int(cfg.hidden_size), num_attention_heads=heads,
                   num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
                   intermediate_size=int(cfg.intermediate_size),
                   vocab_size=int(target.get_output_embeddings().weight.shape[0]))

    def mismatch(self, other: HeadConfig) -> str | None:
        """The first field that differs, as `name: head value != target value`; None when they match."""
        for key, value in asdict(self).items():
            if asdict(other)[key] != value:
                return f"{key}: head {value} != target {asdict(other)[key]}"
        return None


class _NoCache:
    """A sequence attending only to itself (training: whole sequences, causal, no past)."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class EagleHead(nn.Module):
    """fc + one target-architecture decoder layer; reads the target's shared embedding / rotary / LM head."""

    # Its products may run from half-precision weights where that measures faster (`kernels.HALF`): a head only
    # proposes tokens, verification decides them. Its modules are its own (the target's are kept in `_shared`).
    approximate_products = True

    def __init__(self, target: nn.Module, vocab: torch.Tensor | None = None, init_layer: int = -1,
                 taps: tuple[int, ...] = ()):
        """A new head (weights: `load_head`); its layer's attention and norms start as target layer `init_layer`.
        `taps`: target layers whose outputs it reads beside the final features (EAGLE-3)."""
        super().__init__()
        if not TargetModel.of(target).lean:
            raise ValueError(f"an EAGLE head needs a Llama-style decoder layer; {type(target).__name__} has another")
        self.config = HeadConfig.of(target)
        hidden = self.config.hidden_size
        self.taps = tuple(taps)
        self.fc_taps = nn.Linear(len(self.taps) * hidden, hidden, bias=False) if self.taps else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        layers = target.get_decoder().layers
        self.layer = copy.deepcopy(layers[init_layer])
        self.layer.self_attn.layer_idx = 0
        self._pass_through()
        param = next(target.parameters())
        self.to(device=param.device, dtype=param.dtype)
        # shared with the target, kept out of this module's parameters and state_dict (not copied, not saved)
        self._shared = (target.get_decoder(), target.get_output_embeddings())
        self.set_vocab(vocab)

    @torch.no_grad()
    def _pass_through(self) -> None:
        """Start as f̂_{t+1} = f_t: fc copies the feature, the layer's two residual branches add nothing.

        Why: the target's final-norm features have a few very large dimensions. A randomly started head's
        output was far off their scale and training took hundreds of steps to undo it; started here, it is on
        the features' scale from step 0 (docs/lab-notes/decoding-speed.md, "EAGLE head")."""
        hidden = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, hidden:] = torch.eye(hidden)
        self.fc.bias.zero_()
        if self.fc_taps is not None:                 # the fused feature starts as f_t alone
            self.fc_taps.weight.zero_()
        self.layer.self_attn.o_proj.weight.zero_()
        self.layer.mlp.down_proj.weight.zero_()

    def set_vocab(self, vocab: torch.Tensor | None) -> None:
        """Restrict the head's output to these target token ids (None: the whole vocabulary)."""
        self.vocab = None if vocab is None else vocab.to(torch.long).cpu()
        weight = self._shared[1].weight.detach()
        self._rows = weight if vocab is None else weight.index_select(0, vocab.to(weight.device, torch.long))

    def fuse(self, feats: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """[.., H] features f_t (or [.., (taps + 1) H] with the tapped layers) and [..] tokens x_{t+1} -> the
        layer's input [.., H]."""
        hidden = self.config.hidden_size
        if feats.shape[-1] != hidden:   # the target's context features, with tapped layers before f_t
            final = self.final_features(feats)
            feats = final if self.fc_taps is None else final + self.fc_taps(feats[..., :-hidden])
        embed = F.embedding(next_ids, self._shared[0].embed_tokens.weight.detach())
        return self.fc(torch.cat([embed.to(feats.dtype), feats], dim=-1))

    def final_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The final-norm part [.., H] of context features (what the head predicts and the LM head reads)."""
        return feats[..., -self.config.hidden_size:]

    def forward(self, feats: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, kv: Any = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features [B, T, H] at `positions` [B, T] (the positions of `next_ids`).

        `kv`: the head's cache layer (a `GrowableLayer`) to attend to and append to; None = the T inputs alone,
        causally (training). `mask`: additive [B, 1, T, past + T]; None = causal.
        """
        x = self.fuse(feats, next_ids)
        cos, sin = self._shared[0].rotary_emb.forward(x, positions)
        causal, pad = mask is None and x.shape[1] > 1, 0
        past = kv.get_seq_length() if kv is not None else 0
        if causal and past >= x.shape[1]:
            # A catch-up of a few tokens after a long past: a mask. Padded like a prefill instead, its queries
            # would run over past + T rows (docs/lab-notes/decoding-speed.md, "EAGLE head").
            causal, mask = False, fast_forward._causal_mask(past, x.shape[1], x.dtype, x.device)
        elif causal:
            pad = past   # few cached entries: the causal kernel over the queries padded in front (`_layer`)
        return fast_forward._layer(self.layer, kv if kv is not None else _NoCache(), x, cos[:, None], sin[:, None],
                                   mask, causal, pad)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary [.., V'] from predicted features [.., H]."""
        return kernels.product(predicted, self._rows, approximate=self.approximate_products)

    def bare_weights(self) -> list[torch.Tensor]:
        """Weights multiplied outside an nn.Linear (`kernels.install` times their products too)."""
        return [self._rows]

    def full_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Draft logits over the whole vocabulary [.., V], -inf outside the draft vocabulary."""
        part = self.logits(predicted)
        if self.vocab is None:
            return part
        out = part.new_full((*part.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab.to(part.device), part)


def head_path(model_name: str) -> Path:
    """Where the head for `model_name` is read: $RASD_HOME/eagle/<model>.safetensors when trained here, else
    the one shipped inside the package for the embedded model."""
    trained = paths.eagle_path(model_name)
    if trained.exists():
        return trained
    return shipped_path(model_name)


def shipped_path(model_name: str) -> Path:
    """The head shipped for an embedded model (`default` is SmolLM2-135M-Instruct)."""
    name = paths.DEFAULT_MODEL_DIRNAME if model_name == paths.DEFAULT_MODEL else paths.slug(model_name)
    return HEADS_DIR / f"{name}.safetensors"


def save_head(path: Path, head: EagleHead, report: dict[str, Any] | None = None, half: bool = True) -> None:
    """fp16 safetensors of fc + layer (+ the draft vocabulary), the config and report in the metadata.

    Written to a temporary name and renamed: a crash leaves the previous head intact."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    dtype = torch.float16 if half else torch.float32
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in head.state_dict().items()}
    if head.vocab is not None:
        tensors[VOCAB_KEY] = head.vocab.contiguous()
    meta = {"format": FORMAT, "config": asdict(head.config), "taps": list(head.taps), "report": report or {}}
    save_file(tensors, str(tmp), metadata={"rasd": json.dumps(meta)})
    tmp.replace(path)


def read_meta(path: Path) -> dict[str, Any]:
    """The head file's metadata (format, config, training report); ValueError when it is not a head."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("rasd", "{}"))
    except Exception as exc:   # noqa: BLE001 - a truncated or foreign file: one clear line
        raise ValueError(f"{path} is not a readable EAGLE head ({type(exc).__name__})") from exc
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not an EAGLE head written by `rasd train eagle`")
    return meta


def check_head(path: Path, target: nn.Module) -> None:
    """Refuse a head trained for another architecture, with one line naming the difference."""
    meta = read_meta(path)
    diff = HeadConfig(**meta["config"]).mismatch(HeadConfig.of(target))
    if diff is not None:
        raise ValueError(f"{path} was trained for another model ({diff}); train one with `rasd train eagle`")
    layers, taps = len(target.get_decoder().layers), _taps_of(meta)
    if any(not 0 <= i < layers for i in taps):
        raise ValueError(f"{path} reads target layers {taps}; this model has layers 0..{layers - 1}")


def head_taps(path: Path | str) -> tuple[int, ...]:
    """The target layers a head file reads beside the final features (EAGLE-3); () for a plain head."""
    return _taps_of(read_meta(Path(path)))


def _taps_of(meta: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(i) for i in meta.get("taps", ()))


def load_head(target: nn.Module, path: Path | str | None = None, model_name: str = "default") -> EagleHead:
    """The trained head for `target` (default: `head_path(model_name)`), in the target's dtype and device."""
    from safetensors.torch import load_file

    file = Path(path) if path else head_path(model_name)
    if not file.exists():
        raise ValueError(f"no EAGLE head at {file}: run `rasd train eagle --model {model_name} --data builtin` "
                         f"(or pass --eagle PATH)")
    check_head(file, target)
    state = load_file(str(file))
    vocab = state.pop(VOCAB_KEY, None)
    if vocab is not None and (vocab.numel() == 0 or int(vocab.max()) >= HeadConfig.of(target).vocab_size):
        raise ValueError(f"{file}: its draft vocabulary does not fit this model's vocabulary")
    head = EagleHead(target, vocab, taps=head_taps(file))
    param = next(target.parameters())
    head.load_state_dict({k: v.to(param.device, param.dtype) for k, v in state.items()})
    return head.to(param.device).eval()


_HEADS: weakref.WeakKeyDictionary[nn.Module, dict[str, EagleHead]] = weakref.WeakKeyDictionary()


def shared_head(target: nn.Module, path: Path | str | None = None, model_name: str = "default") -> EagleHead:
    """`load_head`, once per target and file: every decoder of a service shares one head (it keeps no state)."""
    file = str(Path(path) if path else head_path(model_name))
    heads = _HEADS.setdefault(target, {})
    if file not in heads:
        heads[file] = load_head(target, file, model_name)
    return heads[file]
