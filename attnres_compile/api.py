"""The Python API, one front door for every format.
torch: `inspect`, `rewrite`, `two_phase`, `fuse_norms`, `convert` and `load` (hf/); ONNX:
`inspect_onnx`, `rewrite_onnx`; PyTorch to a deployable file: `export_onnx`, `export_pt2`.
The ONNX functions import onnx when called (with ml_dtypes, ~0.7 s): `convert` and `rewrite` do without."""

import os

from .core.report import ExportResult, Report
from .fx.pipeline import RewriteResult, inspect, inspect_traced, rewrite
from .fx.site_norm import fuse_norms
from .fx.two_phase import two_phase
from .hf import convert, load
from .hf import ship as _ship
from .pt2.export import export_pt2

__all__ = ["ExportResult", "Report", "RewriteResult", "convert", "export_onnx", "export_pt2", "fuse_norms", "inspect",
           "inspect_onnx", "inspect_traced", "load", "rewrite", "rewrite_onnx", "two_phase"]


def inspect_onnx(path, config=None, input_shapes=None) -> Report:
    """Analyse the ONNX file at `path` without rewriting it (onnx/pipeline.py)."""
    from .onnx import pipeline

    return pipeline.inspect_onnx(path, config, input_shapes)


def rewrite_onnx(path, output, config=None, verify_outputs: bool = True, input_shapes=None, force: bool = False,
                 verify_timeout: float | None = None, fuse_norms: bool = False, queries=None,
                 rewrite_chains: bool = True, weights: str | None = None, eval_ids=None):
    """Rewrite the ONNX file at `path` to AttnRes and write it to `output` (onnx/pipeline.py).
    `queries`: an AttnRes checkpoint folder or a converted model whose trained pseudo-queries (and
    config) the file takes, sites matched by chain, index and size; e.g. for an onnxruntime-genai
    folder of the base model, `rewrite_onnx("base/model.onnx", "out/model.onnx", queries="tuned")`.
    `rewrite_chains` and `weights` as in onnx/pipeline.py."""
    from .onnx import pipeline

    found, where = None, "the checkpoint"
    if queries is not None:
        where = str(queries) if isinstance(queries, (str, os.PathLike)) else f"the {type(queries).__name__}"
        saved, found = _ship.queries(queries)
        config = _ship.config_for(saved, config, where)
    return pipeline.rewrite_onnx(path, output, config, verify_outputs=verify_outputs, input_shapes=input_shapes,
                                 force=force, verify_timeout=verify_timeout, fuse_norms=fuse_norms,
                                 queries=found, queries_from=where, rewrite_chains=rewrite_chains,
                                 weights=weights, eval_ids=eval_ids)


def export_onnx(model, example_inputs, output, config=None, verify_outputs: bool = True,
                verify_timeout: float | None = None, dynamic: str | None = None, with_past: bool = False,
                fuse_norms: bool = False, rewrite_chains: bool = True, weights: str | None = None, eval_ids=None):
    """Rewrite a PyTorch model and export it to AttnRes ONNX at `output` (onnx/pipeline.py).
    With `with_past`, an HF causal LM whose layers are alike (a converted one with its trained
    queries) is exported as three layers and grown to its depth (hf/export.py), else traced whole."""
    from .onnx import pipeline

    reason = None
    if with_past and not fuse_norms and rewrite_chains and dynamic is None:
        from .hf.export import export_onnx_grown

        if weights and eval_ids is None:
            eval_ids = pipeline.example_ids(example_inputs)
        if not (weights and verify_outputs and eval_ids is None):  # else export_onnx says what is missing
            grown = export_onnx_grown(model, output, config, verify_outputs, verify_timeout, weights, eval_ids)
            if grown is not None and not isinstance(grown, str):
                return grown
            reason = grown
    result = pipeline.export_onnx(model, example_inputs, output, config, verify_outputs=verify_outputs,
                                 verify_timeout=verify_timeout, dynamic=dynamic, with_past=with_past,
                                 fuse_norms=fuse_norms, rewrite_chains=rewrite_chains, weights=weights,
                                 eval_ids=eval_ids)
    if reason:
        result.report.data["notes"].append(f"exported whole, not grown from three layers: {reason}")
    return result
