"""ONNX models made importable by TVM's frontend: a folding pre-pass and converters for what it gets wrong.

`simplify` fixes `--static-shape` dims, makes weights listed as inputs initializers, and folds
constants with onnxscript's optimizer (sites kept whole), so run-time shape arithmetic becomes
constants. `ConverterFixes` replaces stock converters that fail or give wrong shapes and turns a
converter failure into one CompileError naming the node; outputs are held to the file's named
dims (named_dims.py).
"""

from __future__ import annotations

import ast
import contextlib
import io
import operator
import re
import warnings

import numpy as np
import onnx
import tvm
import tvm_ffi
from onnxscript.optimizer import _constant_folding
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ...core.errors import CompileError, ConfigError, first_line
from ...onnx.function import DOMAIN, MERGE, OP_TYPE
from ...onnx.optimize import our_rules
from .named_dims import NamedDims
from .tile import tile

SMALL = 8192  # elements: onnxscript's limit for the inputs of the ops it folds
BINARY = ("Add", "Sub", "Mul", "Div", "Mod", "Pow", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")


def simplify(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]] | None = None) -> onnx.ModelProto:
    """A copy of `model` with the given input dims fixed, initializers no longer inputs and constants
    folded (unchanged if folding fails)."""
    model = fix_input_dims(model, input_shapes)
    _initializers_not_inputs(model.graph)
    import onnx_ir as ir
    import onnxscript.optimizer

    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            folded = ir.from_proto(model)
            with our_rules():
                onnxscript.optimizer.optimize_ir(folded, inline=False, should_fold=_fold_small_constant_of_shape)
            _register_folded_constants(folded.graph)
            return ir.to_proto(folded)
    except Exception:  # noqa: BLE001 - folding is an optimisation: import the model as it is
        return model


def _site_output_shape(first_source: int):
    """A partial evaluator for onnxscript's folding that gives a site's output the type and shape of
    its input `first_source` (the output is a weighted sum of that input and ones like it, cast like
    it) and folds nothing. Node-level shape inference knows no `attnres` op, so the output had no
    shape and every Shape of what follows stayed a run-time value TVM's Reshape converter refuses."""
    def evaluate(node, op, state):
        del op, state
        source, output = node.inputs[first_source], node.outputs[0]
        if source is not None and source.shape is not None and (
                output.shape is None or len(output.shape) == len(source.shape)):
            output.type = output.type or source.type
            output.shape = _constant_folding._merge_shapes(output.shape, source.shape)
        return None
    return evaluate


_constant_folding.register(OP_TYPE, DOMAIN)(_site_output_shape(0))
_constant_folding.register(MERGE, DOMAIN)(_site_output_shape(3))  # lse, acc, columns, then the first extra


def _initializers_not_inputs(graph: onnx.GraphProto) -> None:
    """Drop graph inputs that have an initializer of the same name (IR < 4 models list every weight as an
    input, which TVM's importer takes for an untyped tensor); the compiled model binds the weights."""
    weights = {i.name for i in graph.initializer}
    if weights & {i.name for i in graph.input}:
        kept = [i for i in graph.input if i.name not in weights]
        graph.ClearField("input")
        graph.input.extend(kept)


def _register_folded_constants(graph) -> None:
    """Constants the optimizer made without registering them (a folded Reshape target of a legacy
    T5 export: no producer, not an initializer) become initializers, so the file names them."""
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(graph):
        for value in node.inputs:
            if (value is not None and value.const_value is not None and value.producer() is None
                    and not value.is_graph_input() and not value.is_initializer()):
                node.graph.register_initializer(value)


def _fold_small_constant_of_shape(node) -> bool | None:
    """Fold a ConstantOfShape of a constant, small shape too (onnxscript keeps them all, to keep
    models small): legacy exports build the target shapes of Expand and Reshape from them."""
    if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx"):
        shape = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
        if shape is not None and int(np.prod(shape.numpy())) <= SMALL:
            return True
    return None


def fix_input_dims(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]] | None) -> onnx.ModelProto:
    """A copy of `model` whose named inputs have the given dims (ConfigError on a rank or static-dim mismatch),
    and whose other inputs and outputs have them wherever they share the dim's name (`--static-shape
    input_ids:2x5` fixes the batch of every past too, as pipeline.bind_shapes does for a program):
    a batch fixed in one input and symbolic in the next made shapes TVM's importer could not join."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inputs = {i.name: i for i in model.graph.input}
    sizes: dict[str, int] = {}
    for name, dims in (input_shapes or {}).items():
        if name not in inputs:
            raise ConfigError(f"--static-shape names unknown input {name!r}; the model's inputs are {list(inputs)}")
        shape = inputs[name].type.tensor_type.shape
        if len(shape.dim) != len(dims):
            raise ConfigError(f"--static-shape {name}: {len(dims)} dims given, the input has rank {len(shape.dim)}")
        for dim, size in zip(shape.dim, dims):
            if dim.HasField("dim_value") and dim.dim_value != size:
                raise ConfigError(f"--static-shape {name}: dim {dim.dim_value} is static, got {size}")
            if dim.HasField("dim_param") and sizes.setdefault(dim.dim_param, size) != size:
                raise ConfigError(f"--static-shape gives {dim.dim_param} two sizes: {sizes[dim.dim_param]} and {size}")
            dim.Clear()
            dim.dim_value = size
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and sizes:
                _substitute(dim, sizes)
    return model


def _substitute(dim, sizes: dict[str, int]) -> None:
    """A dim named after fixed dims, or an expression of them (optimum's `past_sequence_length +
    sequence_length`, which TVM's importer parses), with their sizes put in; evaluated once no name
    is left. Left symbolic beside a fixed `sequence_length`, the sum's name could not be bound."""
    text = re.sub(r"[A-Za-z_]\w*", lambda m: str(sizes.get(m.group(0), m.group(0))), dim.dim_param)
    value = _evaluate(text)
    if value is not None:
        dim.dim_value = value
    elif text != dim.dim_param:
        dim.dim_param = text


def _evaluate(text: str) -> int | None:
    """The value of an integer expression of +, - and * (None if it names a dim or is anything else)."""
    def value(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(text)
    try:
        return value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        return None


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class ConverterFixes:
    """Mixin for `onnx_frontend.ONNXGraphImporter`: converters TVM 0.27 gets wrong, one-line failures."""

    def _convert_operator(self, op_name: str, inputs, attrs: dict, opset: int):
        if op_name == "ConstantOfShape":
            return self.bb.normalize(_constant_of_shape(inputs[0], attrs, [self._nodes, self._params]))
        try:
            if op_name == "Expand" and _runtime_shape_of_known_length(inputs[0], inputs[1]):
                return self.bb.normalize(_expand_to_runtime_shape(self.bb, *inputs))
            if op_name == "Expand" and isinstance(inputs[1], tvm.ir.GenericConst) and _not_static(inputs[0]):
                return self.bb.normalize(_expand_symbolic_to_constant(self.bb, *inputs))
            quotient = _dim_quotient(*inputs) if op_name == "Div" and len(inputs) == 2 else None
            if quotient is not None:
                return relax.prim_value(quotient)
            if op_name in BINARY and len(inputs) == 2 and _array_beside_dim(*inputs):
                inputs = [_dim_as_tensor(x, _const_dtype(inputs)) if tvm.ir.is_prim_expr(x) else x for x in inputs]
            dims = _reshape_dims(*inputs[:2], attrs, [self._nodes, self._params]) if op_name == "Reshape" else None
            if dims is not None:
                return self.bb.normalize(relax.op.reshape(inputs[0], relax.ShapeExpr(dims)))
            if op_name == "Reshape" and _scalar_to_vector(*inputs[:2]):
                # a shape dim to [1] (BLOOM, XGLM): the stock Reshape wants a tensor, Unsqueeze takes it
                return super()._convert_operator("Unsqueeze", [inputs[0], relax.const([0], "int64")], {}, opset)
            if op_name == "SequenceInsert" and len(inputs) == 3 and isinstance(inputs[2], tvm.ir.GenericConst):
                inputs = [*inputs[:2], _insert_position(inputs[2], len(inputs[0]))]
            if op_name == "SequenceLength" and isinstance(getattr(inputs[0], "ty", None), relax.TupleType):
                # the stock converter takes len() of the input, which only a literal Tuple has
                return relax.const(len(inputs[0].ty.fields), "int64")
            if op_name == "Split" and len(inputs) == 2 and _runtime_shape_of_known_length(inputs[0], inputs[1]):
                return _split_at_runtime(self.bb, inputs[0], inputs[1], attrs.get("axis", 0))
            if op_name == "TopK" and attrs.get("sorted", 1) == 0:
                # the order of an unsorted top k is unspecified, so sorted is one valid answer; the
                # stock converter refuses sorted=0 (DeepSeek-V3's expert routing)
                attrs = {**attrs, "sorted": 1}
            if op_name == "Unsqueeze" and len(inputs) == 2 and isinstance(inputs[1], tvm.ir.GenericConst):
                # one axis as a scalar (onnxscript's folding of ConcatFromSequence writes it so)
                inputs = [inputs[0], relax.const(inputs[1].value.numpy().reshape(-1), "int64")]
            return super()._convert_operator(op_name, inputs, attrs, opset)
        except CompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - converters raise ValueError, TVMError, AssertionError, ...
            node = attrs.get("tvm_custom", {}).get("name") or "?"
            hint = ("; its inputs have dims known only at run time: fixing the model's input dims with "
                    "--static-shape may help" if any(map(_not_static, inputs)) else "")
            raise CompileError(f"TVM's ONNX frontend cannot convert {op_name} (node {node}): {first_line(exc)}{hint}") from None

    def _construct_nodes(self, graph):
        with contextlib.redirect_stdout(io.StringIO()):  # the stock loop prints each failing node's inputs
            return super()._construct_nodes(_Nodes(self._held_to_names(graph, self._tiles_by_shape(graph.node))))

    def _held_to_names(self, graph, nodes):
        """The nodes as the stock loop takes them; after each, its outputs held to the dims the
        file names for them (named_dims.py)."""
        names = NamedDims(graph, self._inputs)
        for node in nodes:
            yield node
            for output in node.output:
                if output in self._nodes:
                    self._nodes[output] = names.held(self.bb, output, self._nodes[output])

    def _tiles_by_shape(self, nodes):
        """The graph's nodes as the stock loop takes them, one at a time, but for each Tile whose
        counts are a shape (`Concat(Shape(x)[:1], [1, 1])`): converted here, when the node is reached,
        by tile.py. The stock loop refuses a shape as input of any op but its listed few."""
        for node in nodes:
            reps = self._nodes.get(node.input[1]) if node.op_type == "Tile" else None
            if not isinstance(reps, relax.ShapeExpr):
                yield node
                continue
            try:
                data = self._nodes[node.input[0]]
                self._nodes[node.output[0]] = self.bb.normalize(tile(self.bb, data, list(reps.values)))
            except Exception as exc:  # noqa: BLE001 - as in _convert_operator
                raise CompileError(f"TVM's ONNX frontend cannot convert Tile (node {node.name}): "
                                   f"{first_line(exc)}") from None


class _Nodes:
    """A graph as `_construct_nodes` reads it: only its nodes, here produced while it converts them."""

    def __init__(self, nodes):
        self.node = nodes


def _dim_quotient(lhs, rhs) -> tvm.tirx.PrimExpr | None:
    """floordiv(lhs, rhs) for a dim expression `lhs` that is provably >= 0 and a positive integer
    constant `rhs`, where it equals ONNX's truncating integer Div; None otherwise. The stock
    converter writes truncdiv, which TVM does not equate with the floordiv of its own shape rules:
    wav2vec2's `s // 10 - 1` came out as both, and reshapes between them failed."""
    if not tvm.ir.is_prim_expr(lhs) or not isinstance(rhs, tvm.ir.GenericConst):
        return None
    divisor = rhs.value.numpy()
    dtype = str(getattr(lhs, "dtype", None) or lhs.ty)
    if divisor.size != 1 or divisor.dtype.kind not in "iu" or divisor.item() <= 0 or not dtype.startswith("int"):
        return None
    analyzer = tvm.sym.Analyzer()
    for var in tvm.tirx.analysis.undefined_vars(lhs):  # shape vars: sizes, never negative
        analyzer.update(var, tvm.sym.ConstIntBound(0, tvm.sym.ConstIntBound.POS_INF))
    if not analyzer.can_prove(lhs >= 0):
        return None
    return tvm.tirx.floordiv(lhs, tvm.tirx.const(divisor.item(), dtype))


def _not_static(value) -> bool:
    """Whether `value` is a tensor whose shape is not fully known at import."""
    ty = getattr(value, "ty", None)
    if not isinstance(ty, relax.TensorType):
        return False
    return not isinstance(ty.shape, relax.ShapeExpr) or any(not isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values)


def _scalar_to_vector(data, shape) -> bool:
    """Whether a Reshape turns a shape dim (a PrimValue, from Gather or Squeeze of a shape) into a
    1-element vector."""
    return (tvm.ir.is_prim_expr(data) and isinstance(shape, tvm.ir.GenericConst)
            and shape.value.numpy().reshape(-1).tolist() in ([1], [-1]))


def _array_beside_dim(a, b) -> bool:
    """Whether a binary op takes a constant of rank >= 1 and a symbolic dim (a prim value)."""
    def array(x):
        return isinstance(x, tvm.ir.GenericConst) and x.value.numpy().ndim >= 1
    return (array(a) and tvm.ir.is_prim_expr(b)) or (array(b) and tvm.ir.is_prim_expr(a))


def _const_dtype(inputs) -> str:
    return next(str(x.value.numpy().dtype) for x in inputs if isinstance(x, tvm.ir.GenericConst))


def _dim_as_tensor(dim, dtype: str) -> relax.Expr:
    """A symbolic dim as a 0-d tensor of `dtype`, so that the op broadcasts as ONNX does. The stock
    binary converters fold a constant and a dim with numpy into one scalar: `[0] + past` became rank 0
    (a later Unsqueeze of it failed) and `arange(5) + past` failed ("can only convert an array of
    size 1"), HF's cache positions once `--static-shape` fixed the sequence but not the past."""
    tensor = relax.op.reshape(relax.op.shape_to_tensor(relax.ShapeExpr([tvm.tirx.Cast("int64", dim)])), [])
    return tensor if dtype == "int64" else relax.op.astype(tensor, dtype)


def _reshape_dims(data, shape, attrs: dict, params) -> list | None:
    """The target dims of a Reshape of symbolic data to a shape with one -1, the -1 solved by cancelling
    the known dims' factors (0 copies the data's dim unless allowzero); None when nothing cancels or no
    known dim is compound. Relax's `prod(data) // prod(known)` is a quotient TVM cannot simplify once a
    sum is a factor, and code generation then fails."""
    if not _not_static(data) or not isinstance(data.ty.shape, relax.ShapeExpr):
        return None
    shape = onnx_frontend.get_constant(shape, params)
    if isinstance(shape, tvm.ir.GenericConst):
        values = shape.value.numpy()
        if values.ndim != 1:
            return None
        dims = [tvm.tirx.IntImm("int64", int(v)) for v in values]
    elif isinstance(shape, relax.ShapeExpr):
        dims = list(shape.values)
    else:
        return None
    have = list(data.ty.shape.values)
    if not attrs.get("allowzero", 0):
        dims = [have[i] if _is_int(d, 0) and i < len(have) else d for i, d in enumerate(dims)]
    unknown = [i for i, d in enumerate(dims) if _is_int(d, -1)]
    if len(unknown) != 1:
        return None
    solved = _quotient(have, [d for i, d in enumerate(dims) if i != unknown[0]])
    return None if solved is None else [solved if i == unknown[0] else d for i, d in enumerate(dims)]


def _is_int(dim, value: int) -> bool:
    return isinstance(dim, tvm.tirx.IntImm) and dim.value == value


def _quotient(dims: list, divisors: list):
    """prod(dims) / prod(divisors) by cancelling factors structurally; None where a factor does not cancel,
    or where no divisor is a compound dim (then TVM simplifies the quotient itself: left to it)."""
    size, factors = _factors(dims)
    count, divisor_factors = _factors(divisors)
    if all(isinstance(f, tvm.tirx.Var) for f in divisor_factors):
        return None
    for factor in divisor_factors:
        match = next((i for i, f in enumerate(factors) if tvm_ffi.structural_equal(f, factor)), None)
        if match is None:
            return None
        factors.pop(match)
    if count == 0 or size % count:
        return None
    terms = ([tvm.tirx.IntImm("int64", size // count)] if size != count or not factors else []) + factors
    result = terms[0]
    for term in terms[1:]:
        result = result * term
    return result


def _factors(dims: list) -> tuple[int, list]:
    """(product of the constant factors, the other factors) of a product of dims."""
    size, factors, stack = 1, [], list(dims)
    while stack:
        dim = stack.pop()
        if isinstance(dim, tvm.tirx.IntImm):
            size *= dim.value
        elif isinstance(dim, tvm.tirx.Mul):
            stack += [dim.a, dim.b]
        else:
            factors.append(dim)
    return size, factors


def _constant_of_shape(shape, attrs: dict, params) -> relax.Expr:
    """ConstantOfShape with its value as a scalar, so that any rank (0 included) works."""
    value = attrs.get("value")
    array = onnx_frontend.get_numpy(value) if value is not None else np.zeros(1, np.float32)
    scalar = relax.const(array.reshape(()), str(array.dtype))
    shape = onnx_frontend.get_constant(shape, params)
    if isinstance(shape, tvm.ir.GenericConst):
        dims = [int(d) for d in shape.value.numpy().reshape(-1)]
        return scalar if not dims else relax.op.full(dims, scalar, str(array.dtype))
    if not isinstance(shape, relax.ShapeExpr):
        shape = relax.op.tensor_to_shape(shape)
    return relax.op.broadcast_to(scalar, shape)


def _insert_position(position, length: int) -> relax.Expr:
    """SequenceInsert's position counted from the front: ONNX reads a negative p as p + n (insert before
    the last tensor at -1), the stock converter as p + n + 1 (append), a silently different model."""
    p = int(position.value.numpy())
    return relax.const(p + length if p < 0 else p, "int64")


def _runtime_shape_of_known_length(data: relax.Expr, shape: relax.Expr) -> bool:
    """Whether `shape` is a 1-D tensor known only at run time whose length is static, and `data`'s
    rank is known: what _expand_to_runtime_shape handles (the stock converter gets the rest)."""
    if isinstance(shape, (tvm.ir.GenericConst, relax.ShapeExpr)) or not isinstance(shape.ty, relax.TensorType):
        return False
    dims = shape.ty.shape.values if isinstance(shape.ty.shape, relax.ShapeExpr) else None
    return (dims is not None and len(dims) == 1 and isinstance(dims[0], tvm.tirx.IntImm)
            and isinstance(data.ty, relax.TensorType) and isinstance(data.ty.shape, relax.ShapeExpr))


def _expand_to_runtime_shape(bb, data: relax.Expr, shape: relax.Expr) -> relax.Expr:
    """Expand to a shape read at run time, broadcasting both ways as ONNX does: the shorter of the
    two is padded with leading 1s and each output dim is the larger (the other is 1 or equal).
    The stock converter broadcast `data` to `shape` as it stands: Expand([1, 3, 1], [3, 1, 3])
    gave [3, 1, 3] instead of [3, 3, 3], and a shape shorter than the data failed."""
    length = int(shape.ty.shape.values[0])
    as_shape = bb.emit(relax.Call(relax.ExternFunc("vm.builtin.tensor_to_shape"), [shape],
                                  ty_args=[relax.ShapeType(ndim=length)]))
    wanted = [tvm.tirx.Var(f"expand_{i}", "int64") for i in range(length)]
    bb.match_cast(as_shape, relax.ShapeType(wanted))
    return _broadcast_right_aligned(bb, data, wanted, _runtime_dim)


def _runtime_dim(wanted: tvm.tirx.Var, dim) -> tvm.tirx.PrimExpr:
    """An output dim of Expand to a run-time shape: a data dim 1 takes the wanted one, another
    static one stays, a symbolic one gives the larger of the two."""
    if isinstance(dim, tvm.tirx.IntImm):
        return wanted if dim.value == 1 else dim
    return tvm.tirx.max(wanted, dim)


def _expand_symbolic_to_constant(bb, data: relax.Expr, shape: tvm.ir.GenericConst) -> relax.Expr:
    """Expand to a constant shape of data whose dims are symbolic (CodeGen's and Cohere's rotary
    tables, `repeat_interleave` over the sequence): the stock converter read every data dim as an
    integer. Right-aligned as ONNX does; a target 1 keeps the data's dim, any other the target's."""
    wanted = [tvm.tirx.IntImm("int64", int(v)) for v in shape.value.numpy().reshape(-1)]
    return _broadcast_right_aligned(bb, data, wanted, lambda w, d: d if w.value in (1, -1) else w)


def _broadcast_right_aligned(bb, data: relax.Expr, wanted: list, pick) -> relax.Expr:
    """`data` broadcast to the dims `wanted`, the two right-aligned as ONNX does (the shorter padded
    with leading 1s); `pick(wanted dim, data dim)` gives each output dim."""
    dims = list(data.ty.shape.values)
    rank = max(len(wanted), len(dims))
    one = tvm.tirx.IntImm("int64", 1)
    wanted, padded = [one] * (rank - len(wanted)) + wanted, [one] * (rank - len(dims)) + dims
    if len(padded) != len(dims):
        data = bb.emit(relax.op.reshape(data, relax.ShapeExpr(padded)))
    return relax.op.broadcast_to(data, relax.ShapeExpr([pick(w, d) for w, d in zip(wanted, padded)]))


def _split_at_runtime(bb, data: relax.Expr, sizes: relax.Expr, axis: int) -> relax.Expr:
    """Split by sizes read at run time (a 1-D tensor of static length): a dynamic slice per piece,
    from the running sum of the sizes before it. The stock converter refuses ("Dynamic Split not
    yet supported"). The other axes are sliced whole (their end clamped to the dim)."""
    rank, pieces = len(data.ty.shape.values), int(sizes.ty.shape.values[0])
    axis %= rank
    sizes = bb.emit(relax.op.astype(sizes, "int64"))
    ends = bb.emit(relax.op.cumsum(sizes, axis=0))
    starts = bb.emit(relax.op.subtract(ends, sizes))

    def vector(at, i: int, rest: int) -> relax.Expr:
        parts = [relax.const(np.full(axis, rest, np.int64), "int64")] if axis else []
        parts.append(relax.op.strided_slice(at, axes=[0], begin=[i], end=[i + 1]))
        if axis < rank - 1:
            parts.append(relax.const(np.full(rank - axis - 1, rest, np.int64), "int64"))
        return relax.op.concat(parts, axis=0) if len(parts) > 1 else parts[0]

    ones = relax.const(np.ones(rank, np.int64), "int64")
    whole = np.iinfo(np.int64).max
    return relax.Tuple([bb.emit(relax.op.dynamic_strided_slice(data, vector(starts, i, 0), vector(ends, i, whole), ones))
                        for i in range(pieces)])
