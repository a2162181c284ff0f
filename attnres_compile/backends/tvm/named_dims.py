"""The dims an ONNX file names, held to while TVM imports it: equal names, one Relax dim.

An exporter's value_info proves shape facts TVM's converters lose (wav2vec2's `(s//10) - 1`
came out clamped and truncdiv'd, and legalization failed). `NamedDims` gives each dim name one
Relax dim: the name parsed as an expression of input dims (+ - * // % of names and integers),
else the first symbolic dim converted under it. A value TVM cannot prove equal is
`relax.match_cast` to it, checked at run time, so a file whose names lie stops rather than
computing with a wrong shape. Constant dims are kept.
"""

from __future__ import annotations

import ast
import operator

import onnx
import tvm
from tvm import relax

Name = str | int | None  # a dim in the file: its dim_param, its dim_value, or unknown


class NamedDims:
    """dim_param -> Relax dim, filled in graph order; `held` returns a value cast to its names' dims."""

    def __init__(self, graph: onnx.GraphProto, inputs: dict[str, relax.Expr]):
        self.names = {vi.name: [_name(d) for d in vi.type.tensor_type.shape.dim]
                      for vi in [*graph.input, *graph.value_info, *graph.output]
                      if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}
        self.dims: dict[str, tvm.tirx.PrimExpr] = {}
        self.analyzer = tvm.sym.Analyzer()
        self.inputs: set[tvm.tirx.Var] = set()  # the inputs' symbolic dims
        for name, value in inputs.items():  # their names, for reading the others
            ty = getattr(value, "ty", None)
            if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
                for n, d in zip(self.names.get(name, ()), ty.shape.values):
                    self.inputs.update(tvm.tirx.analysis.undefined_vars(d))
                    if isinstance(n, str) and isinstance(d, tvm.tirx.Var):
                        self.dims[n] = d

    def held(self, bb: relax.BlockBuilder, name: str, value):
        """`value` (the Relax value of ONNX value `name`) with the dims the file names for it: as
        it is when TVM proves them equal or cannot tell, else a match_cast to them emitted in `bb`."""
        names, ty = self.names.get(name), getattr(value, "ty", None)
        if names is None or not isinstance(ty, relax.TensorType) or ty.ndim != len(names) or not names:
            return value
        have = list(ty.shape.values) if isinstance(ty.shape, relax.ShapeExpr) else [None] * len(names)
        if any(v not in self.inputs for d in have if d is not None for v in tvm.tirx.analysis.undefined_vars(d)):
            return value  # a dim a converter reads at run time (the stock Range's range_len_0): TVM 0.27's
            # memory planning allocates before computing it ("has not been computed": YOLOv8n's anchors)
        want = [self._dim(n, d) for n, d in zip(names, have)]
        if any(w is None for w in want) or all(
                d is not None and (w is d or self.analyzer.can_prove_equal(w, d)) for w, d in zip(want, have)):
            return value
        return bb.match_cast(value, relax.TensorType(want, ty.dtype))

    def _dim(self, name: Name, have):
        """The dim to hold a value to: a constant kept, a symbolic dim under a known name that
        name's, a first one recorded for its name; None where neither the file nor TVM knows it."""
        if isinstance(have, tvm.tirx.IntImm) or name is None:
            return have
        if isinstance(name, int):
            return tvm.tirx.IntImm("int64", name)
        if name not in self.dims:
            read = self._read(name)
            if read is not None or have is not None:
                self.dims[name] = read if read is not None else have
        return self.dims.get(name)

    def _read(self, name: str) -> tvm.tirx.PrimExpr | None:
        """`name` as an expression of the dims named so far (the inputs'), or None."""
        def value(node):
            if isinstance(node, ast.Constant) and type(node.value) is int:
                return tvm.tirx.IntImm("int64", node.value)
            if isinstance(node, ast.Name) and node.id in self.dims:
                return self.dims[node.id]
            if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
                return _OPS[type(node.op)](value(node.left), value(node.right))
            raise ValueError(name)
        try:
            return value(ast.parse(name, mode="eval").body)
        except (SyntaxError, ValueError, RecursionError):
            return None


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: tvm.tirx.floordiv,
        ast.Mod: tvm.tirx.floormod}


def _name(dim) -> Name:
    if dim.HasField("dim_value"):
        return dim.dim_value
    return dim.dim_param if dim.HasField("dim_param") else None
