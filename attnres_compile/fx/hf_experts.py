"""HF mixture-of-experts layers traced with transformers' `batched_mm` experts implementation.

transformers 5 runs an MoE layer's experts with `grouped_mm` by default; on CPU (and under
torch.export) that is the custom op `transformers::grouped_mm_fallback`, which neither torch.onnx
nor TVM's importer can translate (Mixtral, Qwen3-MoE and DeepSeek-V3 failed every route with it).
`batched_mm` computes the same selected-experts sums with a gather and torch.bmm, standard ops
that every route accepts; the `eager` loop is data-dependent and does not export at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

FROM, TO = "grouped_mm", "batched_mm"
NOTE = (f"MoE experts traced with transformers' {TO}: its default {FROM} is a custom op "
        f"(transformers::grouped_mm_fallback) that torch.onnx and TVM cannot import")


@contextlib.contextmanager
def export_friendly(model: Any) -> Iterator[str | None]:
    """While tracing `model`: an HF model that can switch its experts from grouped_mm runs them with
    batched_mm, and NOTE is yielded (else None); its implementation is restored afterwards. A wrapper
    that names the HF model it runs (`wraps`, as decoder.DecoderWithPast does) is looked through."""
    model = getattr(model, "wraps", model)
    current = getattr(model, "get_experts_implementation", None)
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    before = current() if callable(current) and callable(can_set) and can_set() else {}
    if FROM not in before.values():
        yield None
        return
    model.set_experts_implementation({name: TO if impl == FROM else impl for name, impl in before.items()})
    try:
        yield NOTE
    finally:
        model.set_experts_implementation(before)
