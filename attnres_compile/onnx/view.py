"""ONNX frontend: the neutral view (graph_view.py) of an ONNX graph.

One view node per value (node output, graph input, initializer), named by the value. Ops are
classified structurally, never by name (Add/Sum ADD, identity-like PASSTHROUGH, last-dim-keeping
Reshape LAYOUT, constants and shape ops CONST, attnres sites DEPTH_ATTENTION, graph inputs
INPUT). FUSED_SUMS ops have their normed output read as a function of their sum. Shapes come from
shape inference (`inferred_types`); unknown dims get tokens that equal no other.
"""

from __future__ import annotations

import contextlib
import logging

import networkx as nx
import onnx
import onnx.inliner
from onnx import TensorProto

from ..core.errors import CorruptModelError
from ..core.graph_view import Kind, ViewNode, build_view
from . import io as onnx_io
from .function import DOMAIN, SITES
from .site_check import check_sites
from .unfuse_skip_norm import DOMAIN as ORT_DOMAIN

STANDARD_DOMAINS = ("", "ai.onnx")
OUTPUT_SINK = "<graph outputs>"
# learned operators even when their weight is an activation (graph_view.py `learned`)
CONTRACTIONS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger", "ConvInteger", "QLinearMatMul",
                "QLinearConv", "FusedMatMul", "Attention", "MultiHeadAttention"}


# fused ops that return a sum and a norm of it: (domain, op) -> (normed output, sum output, the norm's own
# inputs); the view reads the normed output as a function of the sum, so the sum can be a stream's root
# (onnx/contrib_ops.py). EmbedLayerNormalization: inputs 5 and 6 are gamma and beta.
FUSED_SUMS = {(ORT_DOMAIN, "EmbedLayerNormalization"): (0, 2, (5, 6))}


SYMBOLIC_MAX_DEPTH = 2  # onnxruntime's symbolic inference re-infers every subgraph on each pass: exponential in depth
CPU_SECONDS, CPU_SECONDS_PER_NODE, CPU_SECONDS_PER_GIB = 30.0, 0.05, 60.0  # each shape inference's CPU time limit


def symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """`model` with value_info from onnxruntime's symbolic shape inference, or None where it fails.
    It keeps one symbol per dim through shape arithmetic, so a legacy export's skip and branch get
    equal shapes. It does not know local functions, so it runs on a copy with them inlined.
    """
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        source = onnx.inliner.inline_local_functions(model) if model.functions else model
        with _quiet("onnxruntime.tools.symbolic_shape_infer"), _no_stray_files():
            return SymbolicShapeInference.infer_shapes(source, auto_merge=True, guess_output_rank=True)
    except Exception:  # noqa: BLE001 - the caller goes on with the other inferences
        return None


def onnx_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with value_info from ONNX's own shape inference (`model` itself where it fails)."""
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001
        return model


def _symbolic_types(model: onnx.ModelProto) -> dict:
    inferred = symbolic_shapes(model)
    return {} if inferred is None else value_types(inferred.graph)


def _onnx_types(model: onnx.ModelProto) -> dict:
    return value_types(onnx_shapes(model).graph)


def inferred_types(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]] | None = None,
                   ) -> dict[str, tuple[int, tuple | None]]:
    """`value_types` of the main graph, each dim the best that shape inference knows, the same on any machine.

    Up to three inferences merged per dim (`merge_types`), best first: ONNX's with `input_shapes`
    bound, onnxruntime's symbolic one (consistent symbols through shape arithmetic), ONNX's own.
    Each runs in an isolated child (isolate.py) under a CPU-time limit (30 s + 0.05 s per node, a
    wall-clock backstop four times as long), so a hostile model's hang or memory bomb is refused in
    one line. The symbolic one is skipped where it cannot end (If/Loop/Scan nesting beyond
    SYMBOLIC_MAX_DEPTH, inputs of undefined element type) and left out if it fails. Best effort:
    values left without a shape are reported.
    """
    from ..core.errors import CrashError
    from ..utils import isolate

    nodes = sum(len(g.node) for g, _ in onnx_io.graphs_with_depth(model))
    cpu = CPU_SECONDS + CPU_SECONDS_PER_NODE * nodes + CPU_SECONDS_PER_GIB * model.ByteSize() / 2**30
    run = {"what": "shape inference", "action": "analysing the model", "cpu": cpu, "timeout": 60.0 + 4 * cpu,
           "consequence": "the model is refused"}
    runs = []
    if input_shapes:
        runs.append(isolate.run(_onnx_types, bind_inputs(model, input_shapes), **run))
    if onnx_io.subgraph_depth(model) <= SYMBOLIC_MAX_DEPTH and not _untyped_input(model):
        try:
            runs.append(isolate.run(_symbolic_types, model, **run))
        except (CrashError, isolate.ChildError):
            pass
    runs.append(isolate.run(_onnx_types, model, **run))
    return merge_types(runs, {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim})


def bind_inputs(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A copy of `model` whose graph inputs named in `shapes` have those dims, and whose main graph
    carries no value_info of its own (the file's, computed without the binding, would stand)."""
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    bound.graph.ClearField("value_info")
    for vi in bound.graph.input:
        if vi.name in shapes:
            shape = vi.type.tensor_type.shape
            shape.ClearField("dim")
            for size in shapes[vi.name]:
                shape.dim.add().dim_value = size
    return bound


def _untyped_input(model: onnx.ModelProto) -> bool:
    return any(i.type.HasField("tensor_type") and i.type.tensor_type.elem_type == TensorProto.UNDEFINED
               for i in model.graph.input)


def merge_types(runs: list[dict], names: set[str]) -> dict[str, tuple[int, tuple | None]]:
    """One `value_types` from several inference runs, best first: each dim a size where any run has one,
    else the first run's symbol, else None; the element type from the first run that knows it.
    Symbols are per run, so a later run's symbols an earlier run uses are renamed (`unk__3~2`);
    the input dims' own names (`names`) mean the same in every run.
    """
    seen: set = set()
    renamed = []
    for k, types in enumerate(runs):
        own = {d for _, shape in types.values() for d in shape or () if isinstance(d, str) and d not in names}
        renamed.append({d: f"{d}~{k}" for d in own & seen})
        seen |= own
    merged: dict[str, tuple[int, tuple | None]] = {}
    for name in dict.fromkeys(v for types in runs for v in types):
        found = [(types[name], rename) for types, rename in zip(runs, renamed) if name in types]
        elem = next((e for (e, _), _ in found if e), 0)
        shapes = [(shape, rename) for (_, shape), rename in found if shape is not None]
        if not shapes:
            merged[name] = (elem, None)
            continue
        rank = len(shapes[0][0])
        shapes = [(shape, rename) for shape, rename in shapes if len(shape) == rank]
        dims = []
        for axis in range(rank):
            options = [rename.get(shape[axis], shape[axis]) for shape, rename in shapes]
            size = next((d for d in options if isinstance(d, int) and d >= 0), None)
            dims.append(size if size is not None else next((d for d in options if d is not None), None))
        merged[name] = (elem, tuple(dims))
    return merged


class _OnnxWithoutSave:
    """The onnx module, but `save_model` writes nothing."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    @staticmethod
    def save_model(*args, **kwargs) -> None:
        return None


@contextlib.contextmanager
def _no_stray_files():
    """Keep onnxruntime's symbolic shape inference from saving `sym_shape_infer_temp.onnx` (and its
    weights) into the working directory when it fails.
    """
    try:
        from onnxruntime.tools import symbolic_shape_infer as ssi
    except ImportError:
        ssi = None
    if ssi is None or not hasattr(ssi, "onnx"):
        yield
        return
    real, ssi.onnx = ssi.onnx, _OnnxWithoutSave(ssi.onnx)
    try:
        yield
    finally:
        ssi.onnx = real


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def value_types(graph: onnx.GraphProto) -> dict[str, tuple[int, tuple | None]]:
    """name -> (elem_type, shape) for every typed value of `graph` (shape dims: int, str or None)."""
    types: dict[str, tuple[int, tuple | None]] = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        shape = tuple(_dim(d) for d in t.shape.dim) if t.HasField("shape") else None
        types[vi.name] = (t.elem_type, shape)
    for init in graph.initializer:
        types[init.name] = (init.data_type, tuple(init.dims))
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in STANDARD_DOMAINS:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                types[node.output[0]] = (value.data_type, tuple(value.dims))
    return types


def _dim(d) -> int | str | None:
    if d.HasField("dim_value"):
        return d.dim_value
    if d.HasField("dim_param"):
        return d.dim_param
    return None


def _shape(name: str, types: dict) -> tuple | None:
    shape = types.get(name, (None, None))[1]
    if shape is None:
        return None
    return tuple(f"?{name}[{i}]" if d is None else d for i, d in enumerate(shape))


def _dtype(name: str, types: dict) -> str | None:
    elem = types.get(name, (None, None))[0]
    return TensorProto.DataType.Name(elem).lower() if elem else None


def _numel_one(name: str, types: dict, consts: set[str]) -> bool:
    shape = types.get(name, (None, None))[1]
    return name in consts and shape is not None and all(d == 1 for d in shape)


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _is_passthrough(node: onnx.NodeProto, types: dict) -> bool:
    """Value-preserving on its first input: Identity, inference Dropout, same-type casts."""
    op = node.op_type
    if op == "Identity":
        return True
    if op == "Dropout":
        training = node.input[2] if len(node.input) > 2 else ""
        return not training  # a training_mode input makes it data-dependent; without one it is identity
    if op in ("Cast", "CastLike"):
        src = types.get(node.input[0], (None, None))[0]
        dst = _attr(node, "to") if op == "Cast" else types.get(node.input[1], (None, None))[0]
        return bool(src) and src == dst
    return False


def _is_layout(node: onnx.NodeProto, types: dict) -> bool:
    """A Reshape that keeps the last (feature) axis whole: [B, T, D] <-> [B*T, D]."""
    if node.op_type != "Reshape":
        return False
    shape_in, shape_out = types.get(node.input[0], (0, None))[1], types.get(node.output[0], (0, None))[1]
    return bool(shape_in) and bool(shape_out) and isinstance(shape_in[-1], int) and shape_in[-1] == shape_out[-1]


def subgraph_reads(node: onnx.NodeProto) -> list[str]:
    """Outer-scope values read by the subgraphs (If/Loop/Scan bodies) of `node`."""
    reads: list[str] = []
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            defined = {v.name for v in g.input} | {i.name for i in g.initializer}
            for n in g.node:
                reads += [i for i in [*n.input, *subgraph_reads(n)] if i and i not in defined]
                defined.update(n.output)
    return list(dict.fromkeys(reads))


def _kind(node: onnx.NodeProto, types: dict) -> Kind:
    if node.domain == DOMAIN and node.op_type in SITES:
        return Kind.DEPTH_ATTENTION
    if node.domain not in STANDARD_DOMAINS:
        return Kind.OP
    if node.op_type in ("Constant", "Shape", "Size"):
        return Kind.CONST
    if node.op_type in ("Add", "Sum"):
        return Kind.ADD
    if _is_passthrough(node, types):
        return Kind.PASSTHROUGH
    if _is_layout(node, types):
        return Kind.LAYOUT
    return Kind.OP


def view_nodes(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]] | None = None) -> list[ViewNode]:
    """The ViewNodes of `model.graph` in topological order (the order ONNX requires); shapes as
    inferred with the inputs of `input_shapes` bound (`inferred_types`)."""
    graph = model.graph
    check_sites(model, value_types(graph))  # before anything trusts (or shape-infers) existing sites
    types = inferred_types(model, input_shapes)  # types only: shape inference may have inlined functions
    initializers = [i.name for i in graph.initializer]
    consts = set(initializers)
    out: list[ViewNode] = []
    for name in initializers:
        out.append(ViewNode(name, Kind.CONST, "initializer", [], _shape(name, types), _dtype(name, types)))
    for vi in graph.input:
        if vi.name not in consts:
            out.append(ViewNode(vi.name, Kind.INPUT, "input", [], _shape(vi.name, types), _dtype(vi.name, types)))
    defined = {n.name for n in out}
    for node in graph.node:
        kind = _kind(node, types)
        inputs = [i for i in node.input if i] + [i for i in subgraph_reads(node) if i not in node.input]
        missing = [i for i in inputs if i not in defined]
        if missing:
            raise CorruptModelError(f"node {node.name or node.op_type} reads {missing[0]!r}, which no earlier node, "
                                    "input or initializer defines (the graph is not topologically sorted or is damaged)")
        target = node.op_type if node.domain in STANDARD_DOMAINS else f"{node.domain}.{node.op_type}"
        scalar = kind == Kind.ADD and (len(inputs) < 2 or any(_numel_one(i, types, consts) for i in inputs))
        is_const = kind == Kind.CONST or (bool(inputs) and all(i in consts for i in inputs))
        fused_sum = FUSED_SUMS.get((node.domain, node.op_type))
        order = list(enumerate(node.output))
        if fused_sum and len(node.output) > fused_sum[1] and node.output[fused_sum[1]]:
            order.sort(key=lambda item: item[0] != fused_sum[1])  # the sum first: the normed output reads it
        else:
            fused_sum = None
        for index, value in order:
            if not value:
                continue
            value_kind = kind if index == 0 or kind == Kind.CONST else Kind.OP  # e.g. Dropout's mask
            if is_const:
                consts.add(value)
            defined.add(value)
            reads = [node.output[fused_sum[1]], *(node.input[i] for i in fused_sum[2] if i < len(node.input))] \
                if fused_sum and index == fused_sum[0] else inputs
            out.append(ViewNode(value, value_kind, target, [i for i in reads if i], _shape(value, types),
                                _dtype(value, types), scalar=scalar and value_kind == Kind.ADD,
                                learned=value_kind == Kind.OP and node.op_type in CONTRACTIONS))
    out.append(ViewNode(OUTPUT_SINK, Kind.OUTPUT, "output", [o.name for o in graph.output]))
    return out


def view_from_onnx(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]] | None = None) -> nx.DiGraph:
    """The neutral view of `model.graph` (node names are the ONNX value names), analysed at
    `input_shapes` where given."""
    return build_view(view_nodes(model, input_shapes))
