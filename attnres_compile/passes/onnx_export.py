"""PyTorch -> ONNX: export a rewritten GraphModule with `torch.onnx.export(dynamo=True)`.

`torch.ops.attnres.depth_attention` is translated (custom_translation_table) into the same
`attnres.DepthAttention` site node the ONNX rewrite emits, and onnx_function.attach_functions
then defines it. The exporter's optimizer would merge every all-zero initializer into one
(pseudo-queries start at zero, like most biases), so it runs with the queries held as graph
inputs, which it leaves alone, and they are initializers again afterwards.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import ir

from .. import op as _op  # noqa: F401  (registers torch.ops.attnres)
from .onnx_function import DOMAIN, DOMAIN_VERSION, OP_TYPE, attach_functions, negative_axis
from .onnx_rewrite import PREFIX

# The signature the exporter's tracer needs to record the node; never registered globally.
_SCHEMA = OpSchema(
    OP_TYPE, DOMAIN, DOMAIN_VERSION,
    inputs=[OpSchema.FormalParameter("inputs", "T", param_option=OpSchema.FormalParameterOption.Variadic,
                                     is_homogeneous=True, min_arity=2)],
    outputs=[OpSchema.FormalParameter("output", "T")],
    type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"], "")],
    attributes=[OpSchema.Attribute("eps", OpSchema.AttrType.FLOAT, ""), OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, ""),
                OpSchema.Attribute("axis", OpSchema.AttrType.INT, "")],
)
_DEPTH_ATTENTION = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION), OP_TYPE, _SCHEMA)


def _translate(sources, query, eps: float, scale: float, dim: int):
    """depth_attention(sources, query, eps, scale, dim) -> attnres.DepthAttention(*sources, query)."""
    axis = negative_axis(dim, len(sources[0].shape)) if dim >= 0 else dim
    return _DEPTH_ATTENTION(*sources, query, eps=eps, scale=scale, axis=axis)


TRANSLATION_TABLE = {torch.ops.attnres.depth_attention.default: _translate}


def auto_dynamic_shapes(args: tuple, kwargs: dict) -> tuple | dict:
    """Dim.AUTO for every dim of every tensor input (a tuple for args, a dict for kwargs-only
    inputs): torch.export keeps dynamic whatever the model does not specialise."""
    def spec(x: Any):
        return {i: torch.export.Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) and x.dim() else None
    if kwargs and not args:
        return {k: spec(v) for k, v in kwargs.items()}
    return tuple(spec(a) for a in args)


def export(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, dynamic_shapes: Any = None) -> onnx.ModelProto:
    """The ONNX model of `module` (a rewritten GraphModule or any module) with its sites as function nodes."""
    kwargs = kwargs or {}
    with contextlib.redirect_stdout(io.StringIO()), _quiet_loggers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # training-mode and deprecation notices of the exporter's internals
        program = torch.onnx.export(module, args, kwargs=kwargs, dynamo=True, dynamic_shapes=dynamic_shapes,
                                    custom_translation_table=TRANSLATION_TABLE, optimize=False, verbose=False)
        graph = program.model.graph
        queries = [v for name, v in graph.initializers.items() if name.startswith(f"{PREFIX}.")]
        graph.inputs.extend(queries)
        program.optimize()
        for q in queries:
            graph.inputs.remove(q)
    model = ir.to_proto(program.model)
    attach_functions(model)
    return model


@contextlib.contextmanager
def _quiet_loggers():
    """Silence the exporter's per-step and per-initializer log lines for the duration."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnx_ir", "onnxscript", "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
