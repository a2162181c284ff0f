"""PyTorch -> .pt2: a rewritten model exported with torch.export and written as an archive."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..core.checks import as_config, split_inputs
from ..core.config import AttnResConfig
from ..core import verify
from ..core.report import ExportResult
from ..fx import decoder, dynamic_dims
from ..fx.pipeline import rewrite
from ..fx.trace import decoder_with_past
from ..utils import outputs, progress
from .write import drop_guards, save


def export_pt2(model: Any, example_inputs: Any, output: str | os.PathLike, config: AttnResConfig | None = None,
               verify_outputs: bool = True, dynamic: str | None = None, with_past: bool = False,
               rewrite_chains: bool = True) -> ExportResult:
    """Rewrite a PyTorch model (fx path) and write it to `output` as a .pt2 archive, atomically.
    The archive takes the model's own call (non-tensor keyword inputs constant at their traced
    values) and returns a flat tuple of named outputs; a failed preserve-mode check writes nothing;
    other arguments as in `export_onnx`.
    """
    config = as_config(config)
    scale = config.scale if rewrite_chains else "preserve"  # the mode its verification is judged in
    if with_past:
        wrapper, args, spec = decoder_with_past(model, example_inputs, None, dynamic)
        result = rewrite(wrapper, args, config, verify_outputs=verify_outputs, dynamic_shapes=spec,
                         rewrite_chains=rewrite_chains)
        verify.refuse_failed(result.report["verification"], scale)
        with progress.stage(f"exporting {Path(output).name}"):
            program = dynamic_dims.export_program(result.graph_module, args, {}, (*spec[:3], *spec[3]),
                                                  "dynamic batch, sequence and past length", result.report.data["notes"])
            drop_guards(program)
            with outputs.staged(output) as stage:
                save(program, stage.path, extra={decoder.GENERATION: decoder.generation_ids(model)})
        return ExportResult(result.report, stage.written)
    result = rewrite(model, example_inputs, config, verify_outputs=verify_outputs, dynamic=dynamic,
                     rewrite_chains=rewrite_chains)
    verify.refuse_failed(result.report["verification"], scale)
    args, kwargs = split_inputs(example_inputs)
    dims = dynamic_dims.parse(dynamic)
    spec = dynamic_dims.export_spec(dims, model, args, kwargs) if result.report["dynamic_dims"] else None
    # non-tensor keyword inputs (use_cache=False) stay inputs, constants at their traced values: plain
    # `torch.export.load(p).module()` then takes the model's own call (torch checks the value; our reader
    # also lets them be left out); TVM's importer drops them (backends/tvm/program_prepare.py)
    if isinstance(spec, dict):
        spec = {k: (None if k in kwargs and not isinstance(kwargs[k], torch.Tensor) else v) for k, v in spec.items()}
    with progress.stage(f"exporting {Path(output).name}"):
        program = dynamic_dims.export_program(result.graph_module, args, kwargs, spec, f"dynamic {dims.text}",
                                              result.report.data["notes"])
        with outputs.staged(output) as stage:
            save(program, stage.path)
    return ExportResult(result.report, stage.written)
