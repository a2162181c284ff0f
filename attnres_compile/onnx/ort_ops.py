"""Default-domain ops that onnx has no schema for but onnxruntime runs, known to onnx's checker while it checks.

onnxruntime registers some ops in the default domain itself (SimplifiedLayerNormalization, in
every onnxruntime-genai file, and experimental ops onnx dropped), which onnx's checker refuses.
`ort_only` picks a model's such ops that onnxruntime has a schema and CPU kernel for;
`known_to_checker` registers onnxruntime's schemas for them with onnx while inside. An op
neither knows stays refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from functools import cache

import onnx
import onnx.defs

CPU = "CPUExecutionProvider"


@cache
def _ort_default_ops() -> dict[str, object]:
    """op type -> onnxruntime's schema, for the default-domain ops onnxruntime has a CPU kernel for
    and onnx has no schema of at all."""
    from onnxruntime.capi import _pybind_state as ort

    kernels = {k.op_name for k in ort.get_all_opkernel_def() if k.domain == "" and k.provider == CPU}
    schemas = {}
    for schema in ort.get_all_operator_schema():
        if schema.domain == "" and schema.name in kernels and not onnx.defs.has(schema.name, ""):
            if schema.name not in schemas or schema.since_version > schemas[schema.name].since_version:
                schemas[schema.name] = schema
    return schemas


def ort_only(ops: Iterable[str]) -> list[str]:
    """The default-domain op types among `ops` that onnx does not define and onnxruntime runs, sorted."""
    missing = {op for op in ops if not onnx.defs.has(op, "")}
    return sorted(missing & _ort_default_ops().keys()) if missing else []


def _onnx_schema(schema) -> onnx.defs.OpSchema:
    """onnxruntime's schema of an op as onnx's OpSchema (no inference function: shapes stay unknown to onnx)."""
    Schema = onnx.defs.OpSchema

    def params(formals):
        return [Schema.FormalParameter(p.name, p.typeStr, param_option=Schema.FormalParameterOption(int(p.option)),
                                       is_homogeneous=p.isHomogeneous) for p in formals]

    attributes = [Schema.Attribute(a.name, Schema.AttrType(int(a.type)), required=a.required)
                  for a in schema.attributes.values()]
    constraints = [(t.type_param_str, list(t.allowed_type_strs), "") for t in schema.type_constraints]
    return Schema(schema.name, "", schema.since_version, inputs=params(schema.inputs), outputs=params(schema.outputs),
                  type_constraints=constraints, attributes=attributes)


@contextlib.contextmanager
def known_to_checker(ops: list[str]) -> Iterator[None]:
    """onnxruntime's schemas of `ops` (from `ort_only`) registered with onnx while inside."""
    registered = []
    try:
        for op in ops:
            if not onnx.defs.has(op, ""):
                schema = _ort_default_ops()[op]
                onnx.defs.register_schema(_onnx_schema(schema))
                registered.append((op, schema.since_version))
        yield
    finally:
        for op, version in registered:
            onnx.defs.deregister_schema(op, version, "")
