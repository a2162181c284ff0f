"""PyTorch -> ONNX: export a rewritten GraphModule with `torch.onnx.export(dynamo=True)`.
The sites are translated into the ONNX rewrite's `attnres.DepthAttention` node and finalized by
the same passes (`passes.FINALIZE`). The queries are held as graph inputs during export, since
the exporter's optimizer would merge all-zero initializers, and become initializers afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Callable
from typing import Any

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import ir

from ..core.errors import TraceError, first_line
from ..fx import dynamic_dims, hf_experts
from ..fx.two_phase import one_pass
from ..ops.delta import depth_attention_delta
from ..ops.depth_attention import depth_attention
from ..ops.site_norm import depth_attention_norm
from ..pt2.write import drop_guards, output_names
from . import passes
from .function import DELTA, DOMAIN, DOMAIN_VERSION, OP_TYPE, PAIR, negative_axis
from .optimize import our_rules
from .rewrite import PREFIX

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
_PAIR_SCHEMA = OpSchema(  # the site + norm pair: sources, query, then the norm's weight and bias where it has them
    PAIR, DOMAIN, DOMAIN_VERSION,
    inputs=[OpSchema.FormalParameter("inputs", "T", param_option=OpSchema.FormalParameterOption.Variadic,
                                     is_homogeneous=True, min_arity=2)],
    outputs=[OpSchema.FormalParameter("mixed", "T"), OpSchema.FormalParameter("normed", "T")],
    type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"], "")],
    attributes=[*_SCHEMA.attributes.values(), OpSchema.Attribute("norm_eps", OpSchema.AttrType.FLOAT, ""),
                OpSchema.Attribute("norm", OpSchema.AttrType.STRING, ""),
                OpSchema.Attribute("affine", OpSchema.AttrType.INT, "")],
)
_DEPTH_ATTENTION_NORM = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION), PAIR, _PAIR_SCHEMA)


_DELTA_SCHEMA = OpSchema(DELTA, DOMAIN, DOMAIN_VERSION, inputs=list(_SCHEMA.inputs), outputs=list(_SCHEMA.outputs),
                         type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)",
                                                  "tensor(double)"], "")],
                         attributes=list(_SCHEMA.attributes.values()))
_DEPTH_ATTENTION_DELTA = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION), DELTA, _DELTA_SCHEMA)


def _translate(sources, query, eps: float, scale: float, dim: int):
    """depth_attention(sources, query, eps, scale, dim) -> attnres.DepthAttention(*sources, query)."""
    axis = negative_axis(dim, len(sources[0].shape)) if dim >= 0 else dim
    return _DEPTH_ATTENTION(*sources, query, eps=eps, scale=scale, axis=axis)


def _translate_pair(sources, query, eps: float, scale: float, dim: int, weight, bias, norm_eps: float, norm: str):
    """depth_attention_norm(...) -> attnres.DepthAttentionNorm(*sources, query[, weight[, bias]]) (onnx/function.py)."""
    params = [p for p in (weight, bias) if p is not None]
    return _DEPTH_ATTENTION_NORM(*sources, query, *params, eps=eps, scale=scale, axis=-1, norm_eps=norm_eps, norm=norm,
                                 affine=len(params))


def _translate_delta(sources, query, base, gate, eps: float, scale: float, dim: int):
    """depth_attention_delta(...) -> attnres.DepthAttentionDelta(*sources, query, base, gate)."""
    axis = negative_axis(dim, len(sources[0].shape)) if dim >= 0 else dim
    return _DEPTH_ATTENTION_DELTA(*sources, query, base, gate, eps=eps, scale=scale, axis=axis)


TRANSLATION_TABLE = {depth_attention: _translate, depth_attention_norm: _translate_pair,
                     depth_attention_delta: _translate_delta}
_LOGGERS = ("torch.onnx", "onnx_ir", "onnxscript", "torch.export", "torch._dynamo",
            *dynamic_dims.EXPORT_LOGGERS)  # the exporter's per-step and per-initializer lines, torch.export's notices


def auto_dynamic_shapes(args: tuple, kwargs: dict) -> tuple | dict | None:
    """Dim.AUTO for every dim of every tensor input (`--dynamic all`)."""
    return dynamic_dims.export_spec(dynamic_dims.parse("all"), None, args, kwargs)


def export_or_static(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, what: str,
                     notes: list[str]) -> onnx.ModelProto:
    """`export` with `dynamic_shapes`; when that fails, with static shapes and a one-line note in `notes`."""
    try:
        return export(module, args, kwargs, dynamic_shapes)
    except Exception as exc:  # noqa: BLE001 - any exporter failure with symbolic dims is retried static
        if dynamic_shapes is None:
            raise
        model = export(module, args, kwargs, None)
        notes.append(f"ONNX export with {what} failed ({first_line(_root_cause(exc), 160)}); exported with static shapes")
        return model


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain: the exporter wraps the reason ("No ONNX function found
    for ...") in "step 3/3 ... Next steps:" messages."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def export(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, dynamic_shapes: Any = None,
           grow: Callable[[ir.Graph], bool] | None = None) -> onnx.ModelProto:
    """The ONNX model of `module` (a rewritten GraphModule or any module) with its sites as function nodes.
    `contiguous()` calls are recorded as clones first, which the exporter's decomposition keeps.
    `grow(graph)` changes the exporter's graph before the optimizer runs (onnx/replicate.py); where
    it returns False, NotGrown is raised.
    """
    args, kwargs = dynamic_dims.dense(args, kwargs or {})
    _read_torchlib_once()
    with contextlib.redirect_stdout(io.StringIO()), dynamic_dims.quiet_loggers(_LOGGERS), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # training-mode and deprecation notices of the exporter's internals
        with hf_experts.export_friendly(module):
            exported = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        drop_guards(exported)
        one_pass(exported.graph_module)  # a two-phase module's sites: regrouped below as the ONNX form does
        _contiguous_as_clone(exported.graph_module)
        names = output_names(exported)  # the .pt2 archive's names (`logits`, `hidden_states.1`)
        try:
            program = torch.onnx.export(exported, dynamo=True, custom_translation_table=TRANSLATION_TABLE, optimize=False,
                                        verbose=False)
        except Exception as exc:  # noqa: BLE001 - any exporter failure, named by its innermost reason
            raise TraceError(f"torch.onnx cannot export the model ({first_line(_root_cause(exc), 200)}); "
                             "write a .pt2 instead (-o X.pt2)") from exc
        graph = program.model.graph
        if grow is not None and not grow(graph):
            raise NotGrown
        queries = [v for name, v in graph.initializers.items() if name.startswith(f"{PREFIX}.")]
        graph.inputs.extend(queries)
        with our_rules():
            program.optimize()
        for q in queries:
            graph.inputs.remove(q)
        _name_outputs(graph, names)
    model = ir.to_proto(program.model)
    _constant_dims_as_values(model.graph)
    passes.run(model, [p() for p in passes.FINALIZE])
    return model


class NotGrown(Exception):
    """`export`'s `grow` left the graph as it was: the caller exports the whole model."""


def _constant_dims_as_values(graph: onnx.GraphProto) -> None:
    """Dims torch.export specialised but wrote as dim_params named after their value (HF Mamba's
    `"8"`) become numbers, so checks do not take them for free dims."""
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param.isdigit():
                dim.dim_value = int(dim.dim_param)


def _read_torchlib_once() -> None:
    """Read torchlib's op list once per process instead of on every export (onnxscript re-parses its
    ~500 functions each time); left alone where torch's exporter is laid out otherwise."""
    try:
        from torch.onnx._internal.exporter import _registration

        apis = _registration.onnxscript_apis
        if not hasattr(apis.get_torchlib_ops, "cache_info"):
            apis.get_torchlib_ops = functools.lru_cache(maxsize=1)(apis.get_torchlib_ops)
    except (ImportError, AttributeError):
        pass


def _name_outputs(graph: ir.Graph, names: list[str]) -> None:
    """Give the graph's outputs the model's own names (the exporter names them after their last
    op, `linear_21`); an output that is also an input or another output, or whose name another
    value holds, keeps the exporter's."""
    if len(names) != len(graph.outputs) or len(set(names)) != len(names):
        return
    taken = {v.name for v in graph.inputs} | {v.name for node in graph for v in node.outputs}
    taken |= set(graph.initializers)
    outputs = list(graph.outputs)
    for value, name in zip(outputs, names):
        if value.name == name or value in graph.inputs or outputs.count(value) > 1 or name in taken:
            continue
        taken.discard(value.name)
        value.name = name
        taken.add(name)


def _contiguous_as_clone(gm: torch.fx.GraphModule) -> None:
    """`aten.contiguous(x)` -> `aten.clone(x, memory_format=contiguous_format)`: the same value and strides."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.contiguous.default:
            node.target = torch.ops.aten.clone.default
            node.kwargs = {"memory_format": torch.contiguous_format}
    gm.recompile()


