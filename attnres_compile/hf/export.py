"""`export_onnx(..., with_past=True)` of an HF causal LM at the cost of three layers.

The whole-model route traces the model with torch.export and exports the rewritten graph through
torch.onnx, whose decompositions retrace it: about a second a SmolLM2 layer each time. Here the
user's original function is exported for a view of the first three layers (replicate.shallow_view),
the ONNX graph grown to the model's depth (onnx/replicate.py), rewritten in ONNX with the model's
own queries (a converted model's trained ones, else zero) and checked against the model itself.
"""

from __future__ import annotations

import os

from torch import nn

from ..core.checks import as_config
from ..core.report import ExportResult
from ..fx.decoder import wrap
from ..onnx.pipeline import export_grown
from . import replicate, ship
from .classes import Converted
from .conversion import is_causal_lm


def export_onnx_grown(model: nn.Module, output: str | os.PathLike, config=None, verify_outputs: bool = True,
                      verify_timeout: float | None = None, weights: str | None = None,
                      eval_ids=None) -> ExportResult | str | None:
    """The export; else nothing is written and the whole model is to be exported: None where this
    route does not apply, or why the model could not be exported this way.

    Args:
        model: an HF causal LM, converted (`convert`, `load`) or not.
        output: the .onnx file.
        config: the AttnResConfig; a converted model's own when None (another one is refused).
    Returns:
        The ExportResult, as `export_onnx` gives, a short reason, or None.
    """
    if not is_causal_lm(model):
        return None
    queries = None
    if isinstance(model, Converted):
        saved, queries = ship.queries(model)
        config = ship.config_for(saved, config, f"the {type(model).__name__}")
    config = as_config(config)
    if config.scale != "preserve":  # the file is compared with the original function, as exported whole
        return None
    found = replicate.shallow_view(model)
    if found is None or isinstance(found, str):
        return found
    view, prefix = found
    return export_grown(wrap(model), wrap(view), "model." + prefix, output, config, queries, verify_outputs,
                        verify_timeout, weights, eval_ids)
