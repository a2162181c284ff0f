"""Unfusing onnxruntime's fused residual norms: each Skip*LayerNormalization back into Add + norm.

onnxruntime-genai's builder and onnxruntime's transformer optimizer fold every residual add into
the next norm, leaving no residual Add for chain analysis. `unfuse` rewrites each node in place
into Add(input, bias) -> Add(., skip) -> LayerNormalization / RMSNormalization (opset >= 23) or
SimplifiedLayerNormalization (axis -1, the node's epsilon, default 1e-12, float statistics);
readers of output 3 (`input_skip_bias_sum`) read the last Add. `Rule.check` gives the reason a
node stays fused; `Unfused` counts per op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import helper

DOMAIN = "com.microsoft"
DEFAULT_EPSILON = 1e-12   # onnxruntime's kDefaultSkipLayerNormEpsilon, both ops
LAYER_NORM_OPSET = 17     # LayerNormalization joined the default domain
RMS_NORM_OPSET = 23       # RMSNormalization joined it


@dataclass(frozen=True)
class Rule:
    """One fused op: its name, the norm it unfuses to and where its optional inputs sit."""

    op_type: str
    beta: int | None  # index of the norm's shift input (None: the op has none)
    bias: int         # index of the optional bias input

    def norm(self, opset: int) -> str | None:
        """The default-domain norm op at `opset`, or None where that opset has none."""
        if self.beta is not None:
            return "LayerNormalization" if opset >= LAYER_NORM_OPSET else None
        return "RMSNormalization" if opset >= RMS_NORM_OPSET else "SimplifiedLayerNormalization"

    def check(self, node: onnx.NodeProto, opset: int) -> str | None:
        """Why `node` stays fused, or None when this rule unfuses it."""
        if not node.output or not node.output[0]:
            return "no output"
        if len(node.input) < 3 or not all(node.input[:3]):
            return "input, skip or gamma missing"
        if len(node.input) > self.bias + 1:
            return f"{len(node.input)} inputs, the op has {self.bias + 1}"
        if any(node.output[1:3]):
            return "its mean or inv_std_var output is used (training statistics)"
        if self.norm(opset) is None:
            return f"opset {opset} has no LayerNormalization (opset {LAYER_NORM_OPSET} or newer)"
        return None

    def replace(self, node: onnx.NodeProto, opset: int, fresh) -> list[onnx.NodeProto]:
        """The default-domain nodes computing `node`'s outputs 0 and 3."""
        inputs = list(node.input) + [""] * (self.bias + 1 - len(node.input))
        x, skip, gamma, bias = inputs[0], inputs[1], inputs[2], inputs[self.bias]
        stem = node.name or node.output[0]
        nodes = []
        if bias:
            biased = fresh(f"{stem}/unfused_bias_add")
            nodes.append(helper.make_node("Add", [x, bias], [biased], name=f"{stem}/unfused_bias_add"))
            x = biased
        total = node.output[3] if len(node.output) > 3 and node.output[3] else fresh(f"{stem}/unfused_sum")
        nodes.append(helper.make_node("Add", [x, skip], [total], name=f"{stem}/unfused_add"))
        norm_inputs = [total, gamma] + ([inputs[self.beta]] if self.beta is not None and inputs[self.beta] else [])
        epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), DEFAULT_EPSILON)
        nodes.append(helper.make_node(self.norm(opset), norm_inputs, [node.output[0]], name=f"{stem}/unfused_norm",
                                      axis=-1, epsilon=epsilon, stash_type=1))
        return nodes


RULES = {r.op_type: r for r in (Rule("SkipLayerNormalization", beta=3, bias=4),
                                Rule("SkipSimplifiedLayerNormalization", beta=None, bias=3))}


@dataclass
class Unfused:
    """What `unfuse` did: nodes unfused per op, and the fused nodes it kept with the reason."""

    counts: dict[str, int] = field(default_factory=dict)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (node name, reason)

    def notes(self) -> list[str]:
        done = [f"{n} {op}" for op, n in self.counts.items()]
        notes = [f"unfused {', '.join(done)} into Add + norm (their sums are residual adds)"] if done else []
        if self.kept:
            name, reason = self.kept[0]
            notes.append(f"{len(self.kept)} fused skip norm(s) kept as they are (e.g. {name}: {reason}); their residual "
                         "adds are not analysed")
        return notes


def unfuse(model: onnx.ModelProto, opset: int) -> Unfused:
    """Rewrite the main graph's Skip*LayerNormalization nodes of `model` (default-domain `opset`) in place."""
    graph = model.graph
    result = Unfused()
    if not any(n.domain == DOMAIN and n.op_type in RULES for n in graph.node):
        return result
    taken = {v for n in graph.node for v in (*n.input, *n.output)} | {v.name for v in (*graph.input, *graph.output)}
    taken |= {i.name for i in graph.initializer}

    def fresh(name: str) -> str:
        k, candidate = 0, name
        while candidate in taken:
            k += 1
            candidate = f"{name}_{k}"
        taken.add(candidate)
        return candidate

    nodes = []
    for node in graph.node:
        rule = RULES.get(node.op_type) if node.domain == DOMAIN else None
        reason = rule.check(node, opset) if rule else None
        if rule is None:
            nodes.append(node)
        elif reason is not None:
            result.kept.append((node.name or node.op_type, reason))
            nodes.append(node)
        else:
            nodes += rule.replace(node, opset, fresh)
            result.counts[node.op_type] = result.counts.get(node.op_type, 0) + 1
    if result.counts:
        del graph.node[:]
        graph.node.extend(nodes)
    return result
