"""The Python API, one front door for every format.
torch: `inspect`, `rewrite`, `two_phase`, `fuse_norms`, `convert` and `load` (hf/); ONNX:
`inspect_onnx`, `rewrite_onnx`; PyTorch to a deployable file: `export_onnx`, `export_pt2`."""

import os

from .core.report import ExportResult, Report
from .fx.pipeline import RewriteResult, inspect, inspect_traced, rewrite
from .fx.site_norm import fuse_norms
from .fx.two_phase import two_phase
from .hf import convert, load
from .hf import ship as _ship
from .onnx import pipeline as _onnx_pipeline
from .onnx.pipeline import export_onnx, inspect_onnx
from .pt2.export import export_pt2

__all__ = ["ExportResult", "Report", "RewriteResult", "convert", "export_onnx", "export_pt2", "fuse_norms", "inspect",
           "inspect_onnx", "inspect_traced", "load", "rewrite", "rewrite_onnx", "two_phase"]


def rewrite_onnx(path, output, config=None, verify_outputs: bool = True, input_shapes=None, force: bool = False,
                 verify_timeout: float | None = None, fuse_norms: bool = False, queries=None,
                 rewrite_chains: bool = True, weights: str | None = None, eval_ids=None):
    """Rewrite the ONNX file at `path` to AttnRes and write it to `output` (onnx/pipeline.py).
    `queries`: an AttnRes checkpoint folder or a converted model whose trained pseudo-queries (and
    config) the file takes, sites matched by chain, index and size; e.g. for an onnxruntime-genai
    folder of the base model, `rewrite_onnx("base/model.onnx", "out/model.onnx", queries="tuned")`.
    `rewrite_chains` and `weights` as in onnx/pipeline.py."""
    found, where = None, "the checkpoint"
    if queries is not None:
        where = str(queries) if isinstance(queries, (str, os.PathLike)) else f"the {type(queries).__name__}"
        saved, found = _ship.queries(queries)
        config = _ship.config_for(saved, config, where)
    return _onnx_pipeline.rewrite_onnx(path, output, config, verify_outputs=verify_outputs, input_shapes=input_shapes,
                                       force=force, verify_timeout=verify_timeout, fuse_norms=fuse_norms,
                                       queries=found, queries_from=where, rewrite_chains=rewrite_chains,
                                       weights=weights, eval_ids=eval_ids)
