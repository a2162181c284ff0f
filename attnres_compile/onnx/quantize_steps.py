"""Verifying quantized graphs: the rewritten model's quantize steps fixed by the original's activations.

A rounding-level change lands an activation near a DynamicQuantizeLinear boundary one integer
step away (docs/design.md §5 says why that matters). So the original's quantize outputs are
recorded (`record`), and each matching node of the rewritten model (`fix_steps`: per-tensor
nodes of the main graph, matched by output name) computes

    y = Where(|x / scale - (y_orig - zero_point)| <= 0.5 + rtol * max|x| / scale, y_orig, QuantizeLinear(x, scale, zp))

with the original's scale and zero point; a real change still moves x past that margin and fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from .two_phase import FreshNames
from .view import STANDARD_DOMAINS as STANDARD

RECORDED = "attnres.recorded."  # prefix of the recorded values' graph outputs and of the fixed model's inputs


@dataclass(frozen=True)
class Step:
    """One quantize node: its outputs (the integers, scale and zero point) by name; `dynamic`: the scale and zero
    point are its outputs (DynamicQuantizeLinear), else its inputs (QuantizeLinear)."""

    y: str
    scale: str
    zero_point: str
    dynamic: bool


def steps(model: onnx.ModelProto) -> list[Step]:
    """The main graph's per-tensor quantize nodes."""
    initial = {i.name: list(i.dims) for i in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.domain not in STANDARD or not node.output or not node.output[0]:
            continue
        if node.op_type == "DynamicQuantizeLinear" and len(node.output) == 3 and all(node.output):
            found.append(Step(node.output[0], node.output[1], node.output[2], True))
        elif (node.op_type == "QuantizeLinear" and len(node.input) == 3 and all(node.input)
              and all(initial.get(n, [1]) in ([], [1]) for n in node.input[1:])):
            found.append(Step(node.output[0], node.input[1], node.input[2], False))
    return found


def record(model: onnx.ModelProto, found: list[Step]) -> list[str]:
    """Add, in place, graph outputs carrying each step's integers, scale and zero point (through Identity nodes,
    so initializers can be recorded too); returns their names in order (3 per step)."""
    names = FreshNames(model.graph)
    recorded = []
    for step in found:
        for value in (step.y, step.scale, step.zero_point):
            out = names.fresh(RECORDED + value)
            model.graph.node.append(helper.make_node("Identity", [value], [out], name=out))
            model.graph.output.append(helper.make_empty_tensor_value_info(out))
            recorded.append(out)
    return recorded


def fix_steps(model: onnx.ModelProto, found: list[Step], recorded: dict[str, np.ndarray], rtol: float) -> dict[str, str]:
    """Rewrite, in place, each quantize node of `model` whose output names a step of `found` (the original's) to
    take the original's step (module docstring); `recorded` maps `record`'s names to the original's arrays.
    Returns {new graph input: recorded name} for the feeds."""
    by_y = {s.y: (s, k) for k, s in enumerate(found)}
    names = FreshNames(model.graph)
    keys = list(recorded)
    feeds: dict[str, str] = {}
    nodes = []
    for node in model.graph.node:
        hit = by_y.get(node.output[0]) if node.domain in STANDARD and node.output else None
        if hit is None or node.op_type not in ("DynamicQuantizeLinear", "QuantizeLinear"):
            nodes.append(node)
            continue
        step, k = hit
        refs = []
        for key in keys[3 * k:3 * k + 3]:
            name = names.fresh(key)
            array = recorded[key]
            model.graph.input.append(helper.make_tensor_value_info(  # no shape: one session for every input size
                name, helper.np_dtype_to_tensor_dtype(array.dtype), None))
            feeds[name] = key
            refs.append(name)
        nodes += _fixed(node, *refs, rtol, names)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return feeds


def _fixed(node: onnx.NodeProto, y_ref: str, scale: str, zero: str, rtol: float, names: FreshNames):
    """The nodes computing `node`'s outputs with the original's step (module docstring)."""
    base = node.name or node.output[0]
    v = {k: names.fresh(f"{base}/fixed_step/{k}") for k in
         ("x", "scale", "steps", "ref", "zero", "ref_steps", "off", "distance", "size", "peak", "rtol", "slack", "half",
          "bound", "near", "quantized")}
    f32 = TensorProto.FLOAT
    out = [helper.make_node("Cast", [node.input[0]], [v["x"]], to=f32),
           helper.make_node("Cast", [scale], [v["scale"]], to=f32),
           helper.make_node("Div", [v["x"], v["scale"]], [v["steps"]]),            # x / scale
           helper.make_node("Cast", [y_ref], [v["ref"]], to=f32),
           helper.make_node("Cast", [zero], [v["zero"]], to=f32),
           helper.make_node("Sub", [v["ref"], v["zero"]], [v["ref_steps"]]),       # y_orig - zero_point
           helper.make_node("Sub", [v["steps"], v["ref_steps"]], [v["off"]]),
           helper.make_node("Abs", [v["off"]], [v["distance"]]),
           helper.make_node("Abs", [v["steps"]], [v["size"]]),
           helper.make_node("ReduceMax", [v["size"]], [v["peak"]], keepdims=0),    # max|x| / scale
           helper.make_node("Constant", [], [v["rtol"]], value=helper.make_tensor(v["rtol"], f32, [], [rtol])),
           helper.make_node("Constant", [], [v["half"]], value=helper.make_tensor(v["half"], f32, [], [0.5])),
           helper.make_node("Mul", [v["peak"], v["rtol"]], [v["slack"]]),
           helper.make_node("Add", [v["slack"], v["half"]], [v["bound"]]),
           helper.make_node("LessOrEqual", [v["distance"], v["bound"]], [v["near"]]),
           helper.make_node("QuantizeLinear", [node.input[0], scale, zero], [v["quantized"]]),
           helper.make_node("Where", [v["near"], y_ref, v["quantized"]], [node.output[0]])]
    if node.op_type == "DynamicQuantizeLinear":
        out += [helper.make_node("Identity", [scale], [node.output[1]]),
                helper.make_node("Identity", [zero], [node.output[2]])]
    for n in out:
        n.name = names.fresh(f"{base}/fixed_step/{n.op_type}")
    return out
