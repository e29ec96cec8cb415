"""The target's final-norm hidden states ("features"), taken from forwards that run anyway.

Why a hook: every forward path (HF, the lean CPU forward, the batched and static steps) ends in the model's
final norm module, so one forward hook on it sees the features of every verified token without a second
forward or `output_hidden_states`. AdaEAGLE's length predictor reads the last one; the EAGLE head is fed
the features of each committed position (`feed`). The hook is installed only when such a reader exists.
A CUDA-graph replay runs no hooks: the static step sets `tap.last` itself.
"""

from __future__ import annotations

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
    """Keeps the output [batch, T, hidden] of the last forward through the target's final norm."""

    def __init__(self, model: nn.Module):
        self.last: torch.Tensor | None = None
        self.calls = 0
        self._handle = final_norm(model).register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.last = output
        self.calls += 1

    def remove(self) -> None:
        self._handle.remove()


def shared_tap(model: nn.Module) -> FinalNormTap:
    """One tap per target model (proposer and sizer share it)."""
    tap = getattr(model, "_rasd_norm_tap", None)
    if tap is None:
        tap = FinalNormTap(model)
        model._rasd_norm_tap = tap
    return tap


def norm_tap(model: nn.Module) -> FinalNormTap | None:
    """The model's tap when a reader installed one (`shared_tap`), else None."""
    return getattr(model, "_rasd_norm_tap", None)


def row_features(model: nn.Module, row: int = 0, width: int = 0, count: int | None = None) -> torch.Tensor | None:
    """Features [count, H] of the first `count` positions (None: all) of batch row `row` in the last forward.

    The tap holds [B, W, H] (a step or a prefill), or [B·W (+ chunk), H] (a step stacked with a prefill chunk,
    `width` = W). None when no reader installed a tap."""
    tap = norm_tap(model)
    if tap is None or tap.last is None:
        return None
    last = tap.last
    if last.dim() == 3:
        return last[row, :count]
    end = row * width + (width if count is None else count)
    return last[row * width: end]


class LayerTaps:
    """Keeps the outputs of some decoder layers in the last forward, each RMS-normalised [B, T, H] (EAGLE-3's
    low and mid features: the residual stream's scale grows with depth, a head's linear map should not see it)."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...]):
        self.last: dict[int, torch.Tensor] = {}
        self._handles = [_decoder(model).layers[i].register_forward_hook(self._hook(i)) for i in layers]
        self.layers = tuple(layers)

    def _hook(self, index: int) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            self.last[index] = out * torch.rsqrt(out.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(out.dtype)
        return keep

    def stacked(self, final: torch.Tensor) -> torch.Tensor:
        """[.., (len(layers) + 1) H]: the tapped layers in order, then the final features `final`."""
        return torch.cat([self.last[i] for i in self.layers] + [final], dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
