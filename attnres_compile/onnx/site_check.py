"""Validate the attnres nodes a model already carries, before it counts as rewritten.

`check_sites` refuses a spoofed or damaged site in one line (CorruptModelError, exit 9): each
attnres node's kind, place (main graph), inputs, outputs and attribute ranges; Merge/Partial
wiring; source and query types where known; and every attnres function byte for byte the one we
write, under opset version 1.
"""

from __future__ import annotations

import math

import onnx
from onnx import AttributeProto, TensorProto, helper

from ..core.errors import CorruptModelError
from .function import (
    DELTA,
    DOMAIN,
    DOMAIN_VERSION,
    MERGE,
    NORMS,
    OP_TYPE,
    PAIR,
    PARTIAL,
    SITES,
    default_opset,
    definition,
    partial_structure,
)

FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
ATTRIBUTES = {  # op type: {attribute: type}
    OP_TYPE: {"eps": AttributeProto.FLOAT, "scale": AttributeProto.FLOAT, "axis": AttributeProto.INT},
    PARTIAL: {"eps": AttributeProto.FLOAT, "axis": AttributeProto.INT, "queries": AttributeProto.INT,
              "carry": AttributeProto.INT},
    MERGE: {"index": AttributeProto.INT, "eps": AttributeProto.FLOAT, "scale": AttributeProto.FLOAT,
            "axis": AttributeProto.INT},
    PAIR: {"eps": AttributeProto.FLOAT, "scale": AttributeProto.FLOAT, "axis": AttributeProto.INT,
           "norm_eps": AttributeProto.FLOAT, "norm": AttributeProto.STRING, "affine": AttributeProto.INT},
}
ATTRIBUTES[DELTA] = ATTRIBUTES[OP_TYPE]
ADVICE = "the file is damaged or was not written by attnres-compile; rewrite the original model again"


class _Bad(Exception):
    """One reason a node or function is malformed."""


def check_sites(model: onnx.ModelProto, types: dict[str, tuple[int, tuple | None]] | None = None) -> int:
    """Raise CorruptModelError if an attnres node or function of `model` is malformed; return the sites.

    `types` (name -> (elem_type, shape), e.g. onnx_view.value_types) enables the type checks."""
    ours = [n for n in model.graph.node if n.domain == DOMAIN]
    where = _nested(model)
    if where:
        raise CorruptModelError(f"attnres node {where} sits inside a subgraph or function; {ADVICE}")
    partials: dict[str, tuple[onnx.NodeProto, int]] = {}  # output name -> (Partial, output index)
    expected: dict[tuple[str, str], onnx.FunctionProto] = {}
    opset = default_opset(model)
    for node in ours:
        label = f"{node.op_type} node {node.name or (node.output[0] if node.output else '')!r}"
        try:
            _check_node(node, partials, types or {})
            name, build = definition(node)
            if node.overload != name:
                raise _Bad(f"its overload is {node.overload!r}, expected {name!r}")
        except _Bad as exc:
            raise CorruptModelError(f"attnres {label} is malformed: {exc}; {ADVICE}") from None
        if (node.op_type, name) not in expected:
            expected[node.op_type, name] = build(opset)
        if node.op_type == PARTIAL:
            partials.update({o: (node, i) for i, o in enumerate(node.output)})
    _check_functions(model, expected)
    if ours and not any(o.domain == DOMAIN and o.version == DOMAIN_VERSION for o in model.opset_import):
        raise CorruptModelError(f"the model uses attnres nodes without importing the attnres opset, version "
                                f"{DOMAIN_VERSION}; {ADVICE}")
    return sum(n.op_type in SITES for n in ours)


def _nested(model: onnx.ModelProto) -> str | None:
    """The name of an attnres node inside a subgraph or a non-attnres function, if any."""
    def walk(nodes) -> str | None:
        for n in nodes:
            for a in n.attribute:
                for g in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                    found = next((m.name or m.op_type for m in g.node if m.domain == DOMAIN), None) or walk(g.node)
                    if found:
                        return found
        return None
    found = walk(model.graph.node)
    for f in model.functions:
        if f.domain != DOMAIN:
            found = found or next((m.name or m.op_type for m in f.node if m.domain == DOMAIN), None) or walk(f.node)
    return found


def _attributes(node: onnx.NodeProto) -> dict:
    spec = ATTRIBUTES.get(node.op_type)
    if spec is None:
        raise _Bad(f"attnres has no operator {node.op_type!r}")
    got = {a.name: a for a in node.attribute}
    if set(got) != set(spec):
        raise _Bad(f"attributes {sorted(got)}, expected {sorted(spec)}")
    for name, kind in spec.items():
        if got[name].type != kind or got[name].ref_attr_name:
            raise _Bad(f"attribute {name} is not a plain {AttributeProto.AttributeType.Name(kind).lower()}")
    attrs = {name: helper.get_attribute_value(a) for name, a in got.items()}
    if "eps" in attrs and not (math.isfinite(attrs["eps"]) and attrs["eps"] > 0):
        raise _Bad(f"eps is {attrs['eps']}, must be positive and finite")
    if "scale" in attrs and not (math.isfinite(attrs["scale"]) and attrs["scale"] > 0):
        raise _Bad(f"scale is {attrs['scale']}, must be positive and finite")
    free = node.op_type in (OP_TYPE, DELTA)  # any negative axis; the others' -1
    if attrs["axis"] >= 0 or (not free and attrs["axis"] != -1):
        raise _Bad(f"axis is {attrs['axis']}, must be {'negative' if free else '-1'}")
    if node.op_type == PAIR:
        attrs["norm"] = attrs["norm"].decode(errors="replace")
        if not (math.isfinite(attrs["norm_eps"]) and attrs["norm_eps"] > 0):
            raise _Bad(f"norm_eps is {attrs['norm_eps']}, must be positive and finite")
        if attrs["norm"] not in NORMS or not 0 <= attrs["affine"] <= (2 if attrs["norm"] == "layer" else 1):
            raise _Bad(f"norm {attrs['norm']!r} with affine {attrs['affine']}: expected layer with 0 to 2 or rms "
                       "with 0 or 1 parameters")
    return attrs


def _check_node(node: onnx.NodeProto, partials: dict, types: dict) -> None:
    """The checks of one node against its operator's attributes, arity, wiring and types."""
    attrs = _attributes(node)
    if any(not name for name in node.input):
        raise _Bad("an input name is empty")
    if node.op_type == OP_TYPE:
        if len(node.input) < 2 or len(node.output) != 1:
            raise _Bad(f"{len(node.input)} inputs and {len(node.output)} outputs, expected sources, a query and one output")
        _check_types(list(node.input[:-1]), node.input[-1], attrs["axis"], types)
        return
    if node.op_type == DELTA:
        if len(node.input) < 4 or len(node.output) != 1:
            raise _Bad(f"{len(node.input)} inputs and {len(node.output)} outputs, expected sources, a query, a base, "
                       "a gate and one output")
        _check_types(list(node.input[:-3]) + [node.input[-2]], node.input[-3], attrs["axis"], types)
        gate = types.get(node.input[-1])
        if gate is not None and (gate[0] not in FLOATS or (gate[1] is not None and math.prod(
                d if isinstance(d, int) else 2 for d in gate[1]) != 1)):
            raise _Bad(f"its gate {node.input[-1]!r} is not a float scalar")
        return
    if node.op_type == PAIR:
        count = len(node.input) - 1 - attrs["affine"]
        if count < 1 or len(node.output) != 2:
            raise _Bad(f"{len(node.input)} inputs and {len(node.output)} outputs, expected sources, a query, "
                       f"{attrs['affine']} norm parameters and two outputs")
        _check_types(list(node.input[:count]), node.input[count], -1, types)
        return
    if node.op_type == PARTIAL:
        queries, carry = attrs["queries"], attrs["carry"]
        if carry not in (0, 1) or queries < 1 or len(node.output) != 5:
            raise _Bad(f"carry {carry}, queries {queries} and {len(node.output)} outputs: expected carry 0 or 1, "
                       "at least one query and 5 outputs")
        shape = partial_structure(node)
        if shape[1] < (0 if carry else 1):
            raise _Bad(f"{len(node.input)} inputs are too few for carry {carry} and {queries} queries")
        if carry:
            carried = [partials.get(i) for i in node.input[:2]]
            if None in carried or [c[1] for c in carried] != [0, 1] or carried[0][0] is not carried[1][0]:
                raise _Bad("its carried history is not the history and rms outputs of one earlier Partial")
        for q in node.input[len(node.input) - queries:]:
            _check_types([], q, -1, types)
        return
    if len(node.input) < 5 or len(node.output) != 1:
        raise _Bad(f"{len(node.input)} inputs, expected lse, acc, columns, at least one extra term and a query")
    source = [partials.get(i) for i in node.input[:3]]
    if None in source or [s[1] for s in source] != [2, 3, 4] or not source[0][0] is source[1][0] is source[2][0]:
        raise _Bad("its lse, acc and columns inputs are not the lse, acc and columns outputs of one earlier Partial")
    partial = source[0][0]
    queries = partial_structure(partial)[2]
    if not 0 <= attrs["index"] < queries:
        raise _Bad(f"index {attrs['index']} is outside its Partial's {queries} queries")
    if node.input[-1] != partial.input[len(partial.input) - queries + attrs["index"]]:
        raise _Bad(f"its query {node.input[-1]!r} is not its Partial's query at index {attrs['index']}")
    _check_types(list(node.input[3:-1]), node.input[-1], -1, types)


def _check_types(sources: list[str], query: str, axis: int, types: dict) -> None:
    known = [types[s] for s in sources if s in types]
    elems = {t[0] for t in known}
    if elems - FLOATS or len(elems) > 1:
        raise _Bad(f"its sources have types {sorted(TensorProto.DataType.Name(e) for e in elems)}, expected one float type")
    shapes = [t[1] for t in known if t[1] is not None]
    if any(-len(s) > axis for s in shapes):
        raise _Bad(f"axis {axis} is out of range for rank-{min(len(s) for s in shapes)} sources")
    sizes = {s[axis] for s in shapes if isinstance(s[axis], int)}
    if query in types:
        elem, shape = types[query]
        if elem not in FLOATS or (shape is not None and len(shape) != 1):
            raise _Bad(f"its query {query!r} is not a float vector")
        if shape is not None and isinstance(shape[0], int) and sizes and sizes != {shape[0]}:
            raise _Bad(f"its query has {shape[0]} features, its sources {sorted(sizes)}")


def _check_functions(model: onnx.ModelProto, expected: dict[tuple[str, str], onnx.FunctionProto]) -> None:
    defined = {}
    for f in model.functions:
        if f.domain != DOMAIN:
            continue
        key = (f.name, f.overload)
        if key not in expected or key in defined:
            raise CorruptModelError(f"the model defines its own function attnres.{f.name} ({f.overload or 'no overload'})"
                                    f", which collides with attnres-compile's site functions; rename its domain")
        if f.SerializeToString() != expected[key].SerializeToString():
            raise CorruptModelError(f"function attnres.{f.name} ({f.overload}) differs from the one attnres-compile "
                                    "writes (edited, or written by another version); rewrite the original model again")
        defined[key] = f
    missing = sorted(set(expected) - set(defined))
    if missing:
        raise CorruptModelError(f"the model has attnres.{missing[0][0]} nodes ({missing[0][1]}) without their function "
                                f"definition; {ADVICE}")
