"""Rewritten models into Relax, each depth-attention site as one placeholder call (sites.py).

`import_model` takes an AttnRes ONNX file, a `.pt2` file or an ExportedProgram and returns the
Relax module with the model's signature and its sites. `from_onnx` has no hook for custom ops,
so `_OnnxImporter` subclasses its graph importer and converts attnres nodes itself (their
function bodies never expanded); `from_exported_program` takes a `custom_convert_map`. A site +
norm pair becomes the site's placeholder and the norm in the forms site_norm.py fuses into one
kernel.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ...core.errors import CompileError, first_line
from ...fx.decoder import GENERATION, flat_input_names, token_ids
from ...fx.two_phase import one_pass
from ...onnx import genai as onnx_genai
from ...onnx import io as onnx_io
from ...onnx.function import DELTA, DOMAIN, MERGE, OP_TYPE, PAIR, PARTIAL, default_opset
from ...onnx.site_check import check_sites
from ...onnx.two_phase import sites as onnx_sites
from ...onnx.view import value_types
from ...utils import pytree_warning
from .onnx_prepare import ConverterFixes, simplify
from .program_prepare import convertible
from .site_norm import emit_norm
from .sites import delta_call, site_call
from .tile import symbolic, tile

TORCH_OP_NAME = "depth_attention.default"
TORCH_PAIR_NAME = "depth_attention_norm.default"
TORCH_DELTA_NAME = "depth_attention_delta.default"


class _OnnxImporter(ConverterFixes, onnx_frontend.ONNXGraphImporter):
    """The stock importer plus the attnres nodes, each site back to one placeholder over its S_k.
    A Partial's outputs become the tuple of its history entries; each Merge is the placeholder over
    those and its extras. The lowering regroups the placeholders itself, as for torch.export models."""

    def _check_for_unsupported_ops(self, graph: onnx.GraphProto) -> None:
        rest = onnx.GraphProto()
        rest.node.extend(n for n in graph.node if not _is_attnres(n))
        super()._check_for_unsupported_ops(rest)

    def _convert_operator(self, op_name: str, inputs, attrs: dict, opset: int):
        if op_name == OP_TYPE:
            *sources, query = [self.bb.normalize(x) for x in inputs]
            return self.bb.normalize(site_call(sources, query, attrs["eps"], attrs["scale"], attrs["axis"]))
        if op_name == DELTA:
            *sources, query, base, gate = [self.bb.normalize(x) for x in inputs]
            return self.bb.normalize(delta_call(sources, query, base, gate, attrs["eps"], attrs["scale"], attrs["axis"]))
        if op_name == PAIR:
            inputs = [self.bb.normalize(x) for x in inputs]
            count = len(inputs) - 1 - attrs["affine"]
            norm = attrs["norm"].decode() if isinstance(attrs["norm"], bytes) else attrs["norm"]
            return _pair(self.bb, inputs[:count], inputs[count], attrs["eps"], attrs["scale"], attrs["axis"],
                         inputs[count + 1:], attrs["norm_eps"], norm)
        if op_name == PARTIAL:
            inputs = list(inputs)  # onnx_input slices mishandle negative bounds
            carried = list(inputs[0].fields) if attrs["carry"] else []
            entries = relax.Tuple(carried + [self.bb.normalize(x) for x in inputs[2 * attrs["carry"]:-attrs["queries"]]])
            return relax.Tuple([entries] * 5)
        if op_name == MERGE:
            *extras, query = [self.bb.normalize(x) for x in list(inputs)[3:]]
            return self.bb.normalize(site_call([*inputs[0].fields, *extras], query, attrs["eps"], attrs["scale"], attrs["axis"]))
        if op_name == "Range":
            bounds = [_int_scalar(x, [self._nodes, self._params]) for x in inputs]
            if all(b is not None for b in bounds):
                return self.bb.normalize(relax.op.arange(*bounds, dtype=_dtype(inputs[0])))
            whole = [_whole_scalar(x, [self._nodes, self._params]) for x in inputs]
            if all(b is not None for b in whole):
                return self.bb.normalize(relax.op.astype(relax.op.arange(*whole, dtype="int64"), _dtype(inputs[0])))
        return super()._convert_operator(op_name, inputs, attrs, opset)


def _int_scalar(value, params) -> int | tvm.tirx.PrimExpr | None:
    """An integer Range bound known at import (a constant or symbolic shape value), else None, so an
    arange keeps its input-dim shape instead of the stock converter's fresh, unrelated symbol.
    """
    value = onnx_frontend.get_constant(value, params)
    if isinstance(value, tvm.ir.GenericConst):
        array = value.value.numpy()
        return int(array.item()) if array.size == 1 and array.dtype.kind in "iu" else None
    if tvm.ir.is_prim_expr(value) and _dtype(value).startswith("int"):
        return value
    return None


def _whole_scalar(value, params) -> int | tvm.tirx.PrimExpr | None:
    """A float Range bound that is a whole number: a constant, or a dim cast to float (YOLOv8's
    anchor grid, `arange(w, dtype=float)`), as an integer; None otherwise. Its range is the
    integer range cast (exact below 2**24), and its length a dim expression, where the stock
    converter reads the length at run time and TVM's memory planning then fails on it."""
    value = onnx_frontend.get_constant(value, params)
    if isinstance(value, tvm.ir.GenericConst):
        array = value.value.numpy()
        return int(array.item()) if array.size == 1 and float(array.item()).is_integer() else None
    if isinstance(value, tvm.tirx.Cast) and _dtype(value.value).startswith("int"):
        return value.value
    return None


def _dtype(value) -> str:
    """The dtype of a tensor or of a scalar (prim expressions and shape vars)."""
    ty = value.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else str(getattr(ty, "dtype", ty))


def _is_attnres(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type in (OP_TYPE, PARTIAL, MERGE, PAIR, DELTA)


def _pair(bb: relax.BlockBuilder, sources: list, query, eps: float, scale: float, axis: int, params: list,
          norm_eps: float, norm: str) -> relax.Tuple:
    """(mixed, normed) of a site + norm pair: the site's placeholder and the norm of its value."""
    site = bb.emit(site_call(sources, query, eps, scale, axis))
    return relax.Tuple([site, emit_norm(bb, site, params, norm_eps, norm)])


def from_onnx(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]] | None = None) -> tvm.IRModule:
    """The Relax module of an AttnRes ONNX model: weights bound as constants, the dims in
    `input_shapes` fixed and the others kept symbolic, constants folded first (onnx_prepare)."""
    model = simplify(model, input_shapes)
    strings = [v.name for v in [*model.graph.input, *model.graph.output]
               if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type == onnx.TensorProto.STRING]
    if strings:
        raise CompileError(f"ONNX model has string tensors ({', '.join(map(repr, strings))}), which TVM cannot compile: "
                           "it compiles numeric tensors only")
    importer = _OnnxImporter(None, "float32", keep_params_in_input=False, sanitize=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # per-input "unknown dimension" and renaming notices
        try:
            return importer.from_onnx(model.graph, default_opset(model))
        except CompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - OpNotImplemented, ValueError, InternalError of converters
            raise CompileError(f"TVM's ONNX frontend cannot import this model: {first_line(exc)}") from None


def check_importable(model: onnx.ModelProto, path: Path) -> None:
    """Refuse, in one line and before any weight is read, a file whose ops TVM's ONNX import cannot take: contrib
    ops (`com.microsoft` and other custom domains: GroupQueryAttention, MatMulNBits, Skip*LayerNormalization, ...;
    TVM converts a few of them for static shapes only, so none is let through) and the default-domain ops only
    onnxruntime defines (SimplifiedLayerNormalization). Such a file runs in onnxruntime as it is."""
    ops = Counter(f"{n.domain}.{n.op_type}" for g in onnx_io.graphs_with_depth(model) for n in g[0].node
                  if n.domain not in ("", "ai.onnx", DOMAIN))
    ops.update({op: 1 for op in onnx_io.ort_only_ops(model)})
    if not ops:
        return
    listed = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(ops.items()))
    if onnx_genai.is_genai_folder(path.parent):
        what = (f"run it with onnxruntime as it is: {path.parent} is an onnxruntime-genai folder (og.Model loads it; "
                "`attnres-compile generate` runs its decoder)")
    else:
        what = ("run it with onnxruntime as it is, or compile a file of standard ONNX ops (rewrite the torch.onnx or "
                "optimum export, not the file onnxruntime's optimizer or onnxruntime-genai fused)")
    raise CompileError(f"{path.name} uses onnxruntime ops that TVM's ONNX import cannot take: {listed}; {what}")


def _convert_torch_site(node, importer) -> relax.Var:
    """custom_convert_map entry: depth_attention(sources, query, eps, scale, dim) -> placeholder."""
    sources, query, eps, scale, dim = importer.retrieve_args(node)
    return importer.block_builder.emit(site_call(list(sources), query, eps, scale, dim))


def _convert_torch_delta(node, importer) -> relax.Var:
    """custom_convert_map entry: depth_attention_delta(sources, query, base, gate, eps, scale, dim) -> placeholder."""
    sources, query, base, gate, eps, scale, dim = importer.retrieve_args(node)
    return importer.block_builder.emit(delta_call(list(sources), query, base, gate, eps, scale, dim))


def _convert_torch_pair(node, importer) -> relax.Tuple:
    """custom_convert_map entry: depth_attention_norm(...) -> (placeholder, its norm)."""
    sources, query, eps, scale, dim, weight, bias, norm_eps, norm = importer.retrieve_args(node)
    return _pair(importer.block_builder, list(sources), query, eps, scale, dim,
                 [p for p in (weight, bias) if p is not None], norm_eps, norm)


def from_exported_program(program) -> tvm.IRModule:
    """The Relax module of a torch.export program of a rewritten GraphModule (weights bound)."""
    from tvm.relax.frontend.torch import from_exported_program as convert

    from ... import ops  # noqa: F401  (the program's attnres ops, which the decompositions dispatch)

    return convert(program, custom_convert_map={TORCH_OP_NAME: _convert_torch_site, TORCH_PAIR_NAME: _convert_torch_pair,
                                                TORCH_DELTA_NAME: _convert_torch_delta,
                                                "view.default": _convert_reshape,
                                                "reshape.default": _convert_reshape, "empty.default": _convert_empty,
                                                "empty.memory_format": _convert_empty, "slice.Tensor": _convert_slice,
                                                "repeat.default": _convert_repeat})


def _convert_slice(node, importer) -> relax.Expr:
    """slice(x, dim, start, end) where torch's shapes show the result is all of x, or x's first `end`
    elements: emitted as x itself or as a strided_slice with its end assumed in bounds, since the
    stock converter's clipped extents cannot be proven equal to the dim. Other slices go to the stock
    converter."""
    x, dim, start, end, step = [*node.args, *[None] * 5][:5]
    dim = 0 if dim is None else dim
    before, after = x.meta.get("val"), node.meta.get("val")
    if step not in (None, 1) or not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return importer._slice(node)
    if [str(d) for d in before.shape] == [str(d) for d in after.shape]:
        return importer.env[x]
    if start in (None, 0) and isinstance(end, torch.fx.Node) and str(after.shape[dim]) == str(end.meta.get("val")):
        return importer.block_builder.emit(relax.op.strided_slice(importer.env[x], [dim], [0], [importer.env[end]], [1],
                                                                  assume_inbound=True))
    return importer._slice(node)


def _convert_repeat(node, importer) -> relax.Expr:
    """repeat(x, counts) with a symbolic count (SigLIP's `probe.repeat(batch, 1, 1)`) as tile.py's
    broadcast; integer counts go to the stock converter, which passes them to `relax.op.tile`."""
    x, reps = importer.retrieve_args(node)[:2]
    if not symbolic(list(reps)):
        return importer._repeat(node)
    return importer.block_builder.emit(tile(importer.block_builder, x, list(reps)))


def _convert_empty(node, importer) -> relax.Expr:
    """empty (what `new_empty` decomposes to) as the stock converter's zeros, which reads symbolic
    sizes as dims: its `empty` passed the size list's fx nodes to Relax as they were (HF
    DeepSeek-V3's key expansion: "Mismatched type on argument #0 when calling relax.ShapeExpr")."""
    return importer._zeros(node)


def _convert_reshape(node, importer) -> relax.Expr:
    """view / reshape, the identity skipped as the stock converter does, but with dims compared
    structurally: it compared them with ==, which raises on symbolic dims (HF GPT-BigCode)."""
    x, *dims = importer.retrieve_args(node)
    dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (torch.Size, tuple, list)) else dims
    current = importer.shape_of(x)
    if current is not None and len(current) == len(dims) and all(
            tvm_ffi.structural_equal(have, tvm.tirx.IntImm("int64", want) if isinstance(want, int) else want)
            for have, want in zip(current, dims)):
        return x
    return importer._emit_torch_reshape(x, dims)


@dataclass
class ImportedModel:
    """A model in Relax with what the artifact's manifest needs: input and output names in the
    order of main's parameters and results, and one dict per site in program order."""

    mod: tvm.IRModule
    kind: str  # "onnx" or "torch"
    inputs: list[str]
    outputs: list[str]
    sites: list[dict] = field(default_factory=list)
    generation: dict | None = None  # a decoder's end-of-sequence ids as its source recorded them (decoder.GENERATION)


def import_model(model: str | os.PathLike | torch.export.ExportedProgram,
                 input_shapes: dict[str, tuple[int, ...]] | None = None) -> ImportedModel:
    """Import an AttnRes ONNX file, a .pt2 file or an ExportedProgram into Relax; an ONNX file's
    inputs named in `input_shapes` get those dims before import (pipeline.bind_shapes fixes
    them for the other formats)."""
    if isinstance(model, torch.export.ExportedProgram):
        return _import_program(model)
    path = Path(model)
    if path.suffix.lower() == ".pt2":
        from ...pt2 import load  # validated: never runs code stored in the archive

        loaded = load(path)
        imported = _import_program(loaded.program)
        if len(loaded.outputs) == len(imported.outputs):
            imported.outputs = loaded.outputs
            imported.inputs = flat_input_names(imported.inputs, imported.outputs)  # a decoder's pasts as ONNX names them
        imported.generation = token_ids(loaded.meta.get(GENERATION))
        return imported
    proto = onnx_io.load(path, with_data=False)
    check_importable(proto, path)
    onnx_io.load_data(proto, path)
    check_sites(proto, value_types(proto.graph))
    initializers = {i.name for i in proto.graph.initializer}
    sites = [{"name": s.node.name, "query": s.query, "sources": len(s.sources), "eps": s.eps, "scale": s.scale,
              "axis": s.axis} for s in onnx_sites(proto.graph)]
    metadata = {p.key: p.value for p in proto.metadata_props}
    return ImportedModel(from_onnx(proto, input_shapes), "onnx", [i.name for i in proto.graph.input if i.name not in initializers],
                         [o.name for o in proto.graph.output], sites, token_ids(metadata.get(GENERATION)))


def _import_program(program: torch.export.ExportedProgram) -> ImportedModel:
    program = convertible(program)  # a copy TVM's frontend can convert (program_prepare.py)
    one_pass(program.graph_module)  # two-phase sites back to one each: the lowering regroups them
    signature = program.graph_signature
    params = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    sites = []
    for node in program.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name in (TORCH_OP_NAME, TORCH_PAIR_NAME, TORCH_DELTA_NAME):
            sources, query, *_, eps, scale, dim = node.args[:7] if name == TORCH_DELTA_NAME else node.args[:5]
            sites.append({"name": node.name, "query": params.get(query.name, query.name), "sources": len(sources),
                          "axis": int(dim), "eps": float(eps), "scale": float(scale)})
    try:
        with pytree_warning.silenced():  # the frontend copies the program
            mod = from_exported_program(program)
    except Exception as exc:  # noqa: BLE001 - the frontend asserts on unsupported ops
        raise CompileError(f"TVM's PyTorch frontend cannot import this program: {first_line(exc)}") from None
    return ImportedModel(mod, "torch", list(signature.user_inputs), [str(o) for o in signature.user_outputs], sites)
