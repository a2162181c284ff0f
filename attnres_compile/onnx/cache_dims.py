"""Sizes a graph fixes for the symbolic dims of its KV-cache inputs: the head size, read off the attention op.

onnxruntime-genai names the last dim of every past key/value input `kv_cache_dim`, though only
the attention op's head size fits, so verification must feed that size. `head_sizes` reads it
off the op that reads the cache (its attributes and the query's feature size through casts and
bias adds) for com.microsoft GroupQueryAttention, MultiHeadAttention and Attention, and opset 23
Attention. A dim whose readers disagree, or whose size does not divide, gets none.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from .unfuse_skip_norm import DOMAIN as MS
from .view import STANDARD_DOMAINS as STANDARD


@dataclass(frozen=True)
class Implied:
    """`size` of the dim named `name`, and why: the op that fixes it."""

    name: str
    size: int
    why: str


def head_sizes(model: onnx.ModelProto) -> dict[str, Implied]:
    """{dim_param: Implied} for the symbolic head-size dims of `model`'s past key/value inputs."""
    graph = model.graph
    inputs = {i.name: i for i in graph.input}
    producers = {o: n for n in graph.node for o in n.output if o}
    facts = _Facts(graph, producers)
    found: dict[str, Implied] = {}
    clash: set[str] = set()
    for node in graph.node:
        rule = _RULES.get((MS if node.domain == MS else "" if node.domain in STANDARD else None, node.op_type))
        if rule is None:
            continue
        past_slots, head = rule
        for slot in past_slots:
            if slot >= len(node.input) or node.input[slot] not in inputs:
                continue
            dims = inputs[node.input[slot]].type.tensor_type.shape.dim
            if not dims or not dims[-1].dim_param:
                continue
            size = head(node, facts)
            name = dims[-1].dim_param
            if size is None or size <= 0:
                continue
            implied = Implied(name, size, f"the head size {node.op_type} {node.name or node.output[0]} reads")
            if name in found and found[name].size != size:
                clash.add(name)
            found.setdefault(name, implied)
    return {k: v for k, v in found.items() if k not in clash}


class _Facts:
    """Static sizes of a graph's values, found by walking back to initializers and op attributes."""

    def __init__(self, graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]):
        self.producers = producers
        self.tensors = {i.name: list(i.dims) for i in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in STANDARD:
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self.tensors[node.output[0]] = list(value.dims)
        self.declared = {}
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            dims = vi.type.tensor_type.shape.dim
            if dims and dims[-1].HasField("dim_value") and dims[-1].dim_value > 0:
                self.declared[vi.name] = dims[-1].dim_value

    def last_dim(self, value: str, depth: int = 0) -> int | None:
        """The static size of `value`'s last axis, or None where the graph does not fix it."""
        if value in self.tensors:
            dims = self.tensors[value]
            return dims[-1] if dims else None
        if value in self.declared:
            return self.declared[value]
        node = self.producers.get(value)
        if node is None or depth > 16 or not node.input:
            return None
        op = node.op_type if node.domain in STANDARD else f"{node.domain}.{node.op_type}"
        if op == f"{MS}.MatMulNBits":
            n = _attr(node, "N")
            return n if isinstance(n, int) else None
        if op in ("MatMul", "MatMulInteger", f"{MS}.FusedMatMul") and len(node.input) > 1:
            return self.last_dim(node.input[1], depth + 1)
        if op == "Gemm" and len(node.input) > 1:
            dims = self.tensors.get(node.input[1])
            if dims and len(dims) == 2:
                return dims[0] if _attr(node, "transB", 0) else dims[1]
            return None
        if op in ("Add", "Sub", "Mul", "Div"):  # a bias or scale: the operand that has a size > 1 decides
            sizes = [self.last_dim(i, depth + 1) for i in node.input[:2]]
            known = [s for s in sizes if s is not None and s > 1]
            return known[0] if known and all(s == known[0] for s in known) else None
        if op in ("Cast", "Identity", "DequantizeLinear", "Relu", "Sigmoid", "Tanh", "Erf", "Gelu", f"{MS}.Gelu",
                  f"{MS}.FastGelu", f"{MS}.RotaryEmbedding"):
            return self.last_dim(node.input[0], depth + 1)
        return None


def _attr(node: onnx.NodeProto, name: str, default=None):
    """An integer (or integer list) attribute of `node`; `default` where it is absent or of another type (a
    hostile file's num_heads may be anything)."""
    a = next((a for a in node.attribute if a.name == name), None)
    if a is None or a.type not in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS):
        return default
    return helper.get_attribute_value(a)


def _divide(total: int | None, parts: int | None) -> int | None:
    if not isinstance(total, int) or not isinstance(parts, int) or total <= 0 or parts <= 0 or total % parts:
        return None
    return total // parts


def _gqa(node: onnx.NodeProto, facts: _Facts) -> int | None:
    heads, kv = _attr(node, "num_heads"), _attr(node, "kv_num_heads")
    q = facts.last_dim(node.input[0])
    packed = len(node.input) < 3 or not node.input[1]
    if packed and not (heads and kv):
        return None
    return _divide(q, heads + 2 * kv if packed else heads)


def _mha(node: onnx.NodeProto, facts: _Facts) -> int | None:
    return _divide(facts.last_dim(node.input[0]), _attr(node, "num_heads"))


def _packed_attention(node: onnx.NodeProto, facts: _Facts) -> int | None:
    sizes = _attr(node, "qkv_hidden_sizes")
    hidden = sizes[0] if isinstance(sizes, list) and sizes else _divide(facts.last_dim(node.input[1]), 3) if len(node.input) > 1 else None
    return _divide(hidden, _attr(node, "num_heads"))


def _onnx_attention(node: onnx.NodeProto, facts: _Facts) -> int | None:
    heads = _attr(node, "q_num_heads")
    q = facts.last_dim(node.input[0])
    return _divide(q, heads) if heads else _divide(q, 1)


# (domain, op) -> (the input slots that take a past key/value, the head size)
_RULES = {(MS, "GroupQueryAttention"): ((3, 4), _gqa),
          (MS, "MultiHeadAttention"): ((6, 7), _mha),
          (MS, "Attention"): ((4,), _packed_attention),
          ("", "Attention"): ((4, 5), _onnx_attention)}
