"""Faster skinny matrix multiplies and tree attention for verification on CPU, by mechanism:

- `mode`: where they apply (per thread, inside `fast_kernels()`, outside `prefill_products()`);
- `forms`: the forms a product of a few rows can take (stock, transposed, padded, MKL/oneDNN packed, half) and
  the packed/half weight copies;
- `choices`: which form each shape and row count takes on this machine, measured and kept per machine
  (`KernelChoices`);
- `linear`: the tuned Linear forward that `install` patches in, and the stacked q/k/v and gate/up products;
- `attention`: tree attention with grouped kv heads for the models that opted in.

Results are the same products and attention in another summation order (differences ~1e-7); a prompt's
forward stays `F.linear` (`prefill_products`). Measured timings: docs/lab-notes/decoding-speed.md, "Kernels".
"""

from rasd.decoding.model.kernels.choices import (
    BUCKETS,
    CHOICES_VERSION,
    MAX_TUNED_ROWS,
    KernelChoices,
    linear_choices,
    machine_id,
    pass_times,
)
from rasd.decoding.model.kernels.forms import (
    HALF,
    ONEDNN,
    PACKED,
    PADDED,
    STOCK,
    TRANSPOSED,
    onednn_available,
    packing_available,
)
from rasd.decoding.model.kernels.linear import (
    GATE_UP,
    QKV,
    REDUCED,
    install,
    product,
    projections,
    stack_products,
)
from rasd.decoding.model.kernels.mode import fast_enabled, fast_kernels, prefill_products, tuned_products

_BUCKETS = BUCKETS   # the row-count buckets, under the name the sizer's comments and tests use

__all__ = [
    "BUCKETS", "CHOICES_VERSION", "GATE_UP", "HALF", "MAX_TUNED_ROWS", "ONEDNN", "PACKED", "PADDED", "QKV", "REDUCED",
    "STOCK", "TRANSPOSED", "KernelChoices", "fast_enabled", "fast_kernels", "install", "linear_choices", "machine_id",
    "onednn_available", "packing_available", "pass_times", "prefill_products", "product", "projections",
    "stack_products", "tuned_products",
]
