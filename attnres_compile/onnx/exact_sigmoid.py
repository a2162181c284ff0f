"""Sigmoid computed to float precision in the onnxruntime reference that verification compares against.

onnxruntime's CPU Sigmoid is a rational approximation accurate to about 1e-7 absolute, not
relative, which failed correct builds of models whose outputs are small sigmoids.
`Reciprocal(Add(Exp(Neg(x)), 1))` runs within float rounding and onnxruntime leaves it unfused.
Only the reference is edited: float, double and float16 Sigmoids of the main graph whose type is
known; below opset 7 (no broadcasting Add) nothing is.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .function import default_opset
from .two_phase import FreshNames
from .view import STANDARD_DOMAINS, onnx_shapes, value_types

EXACT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)
MIN_OPSET = 7  # Add broadcasts a scalar from opset 7 on


def exact_sigmoids(model: onnx.ModelProto) -> int:
    """Replace, in `model` itself, each main-graph Sigmoid of a float type by Reciprocal(Add(Exp(Neg(x)), 1));
    returns how many were replaced (0: `model` is unchanged)."""
    graph = model.graph
    sigmoids = {i for i, n in enumerate(graph.node)
                if n.op_type == "Sigmoid" and n.domain in STANDARD_DOMAINS and n.input}
    if not sigmoids or (default_opset(model) or 0) < MIN_OPSET:
        return 0
    types = _elem_types(graph)
    if any(graph.node[i].input[0] not in types for i in sigmoids):  # intermediate values without value_info
        types = {**_elem_types(onnx_shapes(model).graph), **types}
    names, ones, nodes, replaced = FreshNames(graph), {}, [], 0
    for i, node in enumerate(graph.node):
        elem = types.get(node.input[0]) if i in sigmoids else None
        if elem not in EXACT_TYPES:
            nodes.append(node)
            continue
        if elem not in ones:  # a Constant node, not an initializer: below IR 4 initializers must be inputs too
            ones[elem] = names.fresh(f"exact_sigmoid_one_{TensorProto.DataType.Name(elem).lower()}")
            nodes.append(helper.make_node("Constant", [], [ones[elem]], name=ones[elem],
                                          value=helper.make_tensor(ones[elem], elem, [], [1.0])))
        base = node.name or node.output[0]
        neg, exp, denominator = (names.fresh(f"{base}/exact/{step}") for step in ("neg", "exp", "denominator"))
        nodes += [helper.make_node("Neg", [node.input[0]], [neg], name=neg),
                  helper.make_node("Exp", [neg], [exp], name=exp),
                  helper.make_node("Add", [exp, ones[elem]], [denominator], name=denominator),
                  helper.make_node("Reciprocal", [denominator], [node.output[0]], name=node.name)]
        replaced += 1
    if replaced:
        graph.ClearField("node")
        graph.node.extend(nodes)
    return replaced


def _elem_types(graph: onnx.GraphProto) -> dict[str, int]:
    """value name -> element type, for the values of `graph` whose type is known."""
    return {name: elem for name, (elem, _) in value_types(graph).items() if elem}
