"""The target's final-norm hidden states ("features"), taken from forwards that run anyway.

Why a hook: every forward path (HF, the lean CPU forward, the batched and static steps) ends in the model's
final norm module, so one forward hook on it sees the features of every verified token without a second
forward or `output_hidden_states`. AdaEAGLE's length predictor reads the last one; the EAGLE head is fed
the features of each committed position (`feed`). The hook is installed only when such a reader exists.
A CUDA-graph replay runs no hooks: the static step sets `tap.last` itself. A fused EAGLE-3 head also reads a
few decoder layers' outputs (`FinalNormTap.layers`), stacked before the final features.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of an HF causal LM (Llama-style `model.model`)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm module of an HF causal LM (Llama-style `model.model.norm`)."""
    norm = getattr(_decoder(model), "norm", None)
    if norm is None:
        raise ValueError(f"cannot find the final norm of {type(model).__name__} (expected .model.norm)")
    return norm


class FinalNormTap:
    """Keeps the features of the last forward through the target's final norm: its output [.., H], or with
    `layers` (EAGLE-3's fused features) those decoder layers' outputs, each RMS-normalised, before it
    [.., (len(layers) + 1) H] (`stacked`).

    The layers' outputs are kept by hooks where a forward calls the layer modules (HF), and handed over by the
    lean forwards, which run a layer as a function (`layer_keepers`, `keep`)."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...] = ()):
        self.last: torch.Tensor | None = None
        self.calls = 0
        self.layers: tuple[int, ...] = ()
        self.kept: dict[int, torch.Tensor] = {}
        self._decoder = _decoder(model)
        self._handles = [final_norm(model).register_forward_hook(self._hook)]
        self.set_layers(layers)

    def set_layers(self, layers: tuple[int, ...]) -> None:
        """Read these decoder layers beside the final features from the next forward on."""
        count = len(self._decoder.layers)
        if any(not 0 <= i < count for i in layers):
            raise ValueError(f"tapped layers {list(layers)}: this model's decoder layers are 0..{count - 1}")
        for handle in self._handles[1:]:
            handle.remove()
        self.layers, self.kept = tuple(layers), {}
        self._handles[1:] = [self._decoder.layers[i].register_forward_hook(self._layer_hook(i)) for i in self.layers]
        keepers = _KEEPERS.setdefault(self._decoder, weakref.WeakSet())
        if self.layers:
            keepers.add(self)
        else:
            keepers.discard(self)

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.last = self.stacked(output)
        self.calls += 1

    def _layer_hook(self, index: int) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            self.keep(index, output[0] if isinstance(output, tuple) else output)
        return keep

    def keep(self, index: int, out: torch.Tensor) -> None:
        """Layer `index`'s output [.., H] in this forward, RMS-normalised (the residual stream's scale grows with
        depth; a head's linear map should not see it). Layers not tapped are ignored."""
        if index in self.layers:
            self.kept[index] = layer_feature(out)

    def stacked(self, final: torch.Tensor) -> torch.Tensor:
        """[.., (len(layers) + 1) H]: the tapped layers in order, then the final features `final`."""
        if not self.layers:
            return final
        return torch.cat([self.kept[i] for i in self.layers] + [final], dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        _KEEPERS.get(self._decoder, weakref.WeakSet()).discard(self)


# Side tables keyed weakly by the HF modules (the forwards are handed the module, not an object of ours):
# decoder -> the taps that read some of its layers' outputs (held weakly: a tap holds its decoder), and
# model -> its one tap (a tap holds the decoder and the hooks, never the model, so the model can still go).
_KEEPERS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[FinalNormTap]] = weakref.WeakKeyDictionary()
_TAPS: weakref.WeakKeyDictionary[nn.Module, FinalNormTap] = weakref.WeakKeyDictionary()


def layer_feature(out: torch.Tensor) -> torch.Tensor:
    """A tapped layer's output [.., H] as a fused head reads it: RMS-normalised, without a learnt scale."""
    return out * torch.rsqrt(out.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(out.dtype)


def layer_keepers(decoder: nn.Module) -> tuple[FinalNormTap, ...]:
    """The taps that want the outputs of some of `decoder`'s layers (usually none); a lean forward that runs
    layers as functions hands each layer's output to their `keep`."""
    keepers = _KEEPERS.get(decoder)
    return tuple(keepers) if keepers else ()


def shared_tap(model: nn.Module, layers: tuple[int, ...] = ()) -> FinalNormTap:
    """One tap per target model (proposer and sizer share it); `layers`: the decoder layers a fused EAGLE head
    reads beside the final features (one set per target: a second, different set is refused)."""
    tap = _TAPS.get(model)
    if tap is None:
        tap = _TAPS[model] = FinalNormTap(model, tuple(layers))
    elif layers and tuple(layers) != tap.layers:
        if tap.layers:
            raise ValueError(f"this target already feeds layers {list(tap.layers)} to a head; "
                             f"one target feeds one set of tapped layers, not also {list(layers)}")
        tap.set_layers(tuple(layers))
    return tap


def norm_tap(model: nn.Module) -> FinalNormTap | None:
    """The model's tap when a reader installed one (`shared_tap`), else None."""
    return _TAPS.get(model)


def row_features(model: nn.Module, row: int = 0, width: int = 0, count: int | None = None) -> torch.Tensor | None:
    """Features [count, F] of the first `count` positions (None: all) of batch row `row` in the last forward
    (F = H, or (layers + 1) H with tapped layers).

    The tap holds [B, W, F] (a step or a prefill), or [B·W (+ chunk), F] (a step stacked with a prefill chunk,
    `width` = W). None when no reader installed a tap."""
    tap = norm_tap(model)
    if tap is None or tap.last is None:
        return None
    last = tap.last
    if last.dim() == 3:
        return last[row, :count]
    end = row * width + (width if count is None else count)
    return last[row * width: end]
