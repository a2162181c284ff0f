"""HF mixture-of-experts layers traced with transformers' `batched_mm` experts implementation.
The default `grouped_mm` exports as a custom op neither torch.onnx nor TVM can translate;
`batched_mm` computes the same with gather and bmm, and the `eager` loop does not export at all.
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
