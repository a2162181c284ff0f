"""What a .pt2 may contain: a program is data, never code.
`torch.export.load` evals shape expressions, resolves call targets by name and execs guard code.
Accepted here: arithmetic on shape symbols, torch operators without file I/O, arithmetic, and
listed computing-only operators of other libraries; anything else is UnsafeArchiveError (exit 20)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import torch

from ..core.errors import InputError, UnsafeArchiveError

MAX_EXPR_CHARS = 4096

OPERATOR_FNS = {"getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos", "eq", "ne",
                 "lt", "le", "gt", "ge", "and_", "or_", "not_", "abs"}
_MATH_FNS = {"ceil", "floor", "trunc", "sqrt"}
_TORCH_SYM_FNS = {"sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite", "sym_sum", "_sym_sqrt"}
_NAMESPACES = {"aten", "prims", "attnres", "higher_order"}
# other libraries' operators that compute only, and the module whose import registers them:
# transformers' grouped matmul is how HF MoE layers (Mixtral, Qwen2-MoE, OLMoE) export
_LIBRARY_OPS = {("transformers", "grouped_mm_fallback"): "transformers.integrations.moe"}
_HIGHER_ORDER = {"cond", "while_loop", "map_impl", "wrap_with_set_grad_enabled", "wrap_with_autocast",
                 "auto_functionalized", "auto_functionalized_v2", "invoke_subgraph", "scan", "associative_scan"}
_TARGET = re.compile(r"^torch\.ops\.(?P<ns>[A-Za-z_]\w*)\.(?P<op>[A-Za-z_]\w*)(?:\.(?P<overload>[A-Za-z_]\w*))?$")
_SYMBOL = re.compile(r"^[a-z]{1,6}\d{0,9}$")
_SYMPY_FNS = {"Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Mod", "Abs", "Eq", "Ne",
              "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality",
              "Unequality", "And", "Or", "Not", "floor", "ceiling", "sqrt", "FloorDiv", "ModularIndexing", "Where",
              "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural",
              "FloatPow", "FloatTrueDiv", "IntTrueDiv", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
              "ToFloat", "Identity", "IsNonOverlappingAndDenseIndicator", "oo", "zoo", "nan", "true", "false", "pi",
              "E", "BooleanTrue", "BooleanFalse", "int_oo", "IntInfinity", "NegativeIntInfinity", "S"}
_SYMPY_KEYWORDS = {"positive", "integer", "nonnegative", "negative", "nonpositive", "real", "finite", "zero",
                   "evaluate"}
_POWERS = {"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"}
_GUARD_NAMES = {"L", "max", "min", "abs", "math", "inf", "True", "False"}
_GUARD_ATTRS = {"size", "stride", "storage_offset", "dim", "isnan", "inf", "floor", "ceil", "trunc"}


class _Refused(ValueError):
    pass


def check_program_json(model: Any, path: Path) -> None:
    """Every string of model.json that torch evaluates or resolves is plain: call targets are
    torch operators or arithmetic, shape expressions and guards are arithmetic on symbols."""
    if not isinstance(model, dict):
        raise InputError(f"{path}: damaged or unsupported .pt2 archive (models/model.json is not an object)")
    try:
        _walk(model)
        guards = model.get("guards_code") or []
        if not isinstance(guards, list):
            raise _Refused("guards_code is not a list")
        for guard in guards:
            _check_python(guard, _GUARD_NAMES, _GUARD_ATTRS, "guard")
    except _Refused as exc:
        raise UnsafeArchiveError(f"{path}: this .pt2 holds code, not only a program ({exc}); refusing to load it") from None
    except RecursionError:
        raise InputError(f"{path}: damaged or unsupported .pt2 archive (models/model.json nests too deep)") from None


def _walk(value: Any, key: str = "") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if k in ("target", "as_operator") and isinstance(v, str):
                _check_target(v)
            elif k == "expr_str":
                _check_python(v, set(), set(), "shape expression")
            elif k in ("as_custom_obj", "custom_obj"):
                raise _Refused(f"a custom object argument ({str(v)[:60]})")
            _walk(v, k)
    elif isinstance(value, list):
        for v in value:
            _walk(v, key)


def _check_target(target: str) -> None:
    if target.startswith("_operator."):
        ok = target.split(".", 1)[1] in OPERATOR_FNS
    elif target.startswith("math."):
        ok = target.split(".", 1)[1] in _MATH_FNS
    elif target.startswith("torch.") and target.split(".", 1)[1] in _TORCH_SYM_FNS:
        ok = True
    else:
        m = _TARGET.match(target)
        if m and (m["ns"], m["op"]) in _LIBRARY_OPS:
            _register(m["ns"], m["op"])
            return
        ok = bool(m) and m["ns"] in _NAMESPACES and (m["ns"] != "higher_order" or m["op"] in _HIGHER_ORDER)
        ok = ok and not does_io(m["ns"], m["op"])
    if not ok:
        raise _Refused(f"call target {target[:80]!r}")


def _register(namespace: str, op: str) -> None:
    """Import the module that registers a _LIBRARY_OPS operator, so that torch can resolve it."""
    import importlib

    module = _LIBRARY_OPS[(namespace, op)]
    try:
        importlib.import_module(module)
    except ImportError:
        raise InputError(f"this .pt2 calls the operator {namespace}::{op}: install {module.split('.')[0]} "
                         "to load it") from None


def does_io(namespace: str, op: str) -> bool:
    """aten operators that read or write files or print: save, from_file, _print, warn."""
    return namespace == "aten" and op in {"save", "from_file", "_print", "warn", "load"}


def _check_python(source: Any, names: set[str], attrs: set[str], what: str) -> None:
    """`source` is an expression of numbers, shape symbols and the allowed names, attributes and calls."""
    if not isinstance(source, str) or len(source) > MAX_EXPR_CHARS:
        raise _Refused(f"a {what} that is not a short string")
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _Refused(f"a {what} that is not an expression: {source[:60]!r}") from None
    allowed_names = names | (_SYMPY_FNS if what == "shape expression" else set())
    count = 0
    for node in ast.walk(tree):
        count += 1
        if count > 2000:
            raise _Refused(f"a {what} of more than 2000 terms")
        if isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.BoolOp,
                             ast.Compare, ast.UnaryOp)):
            if isinstance(node, (ast.Pow, ast.BitXor, ast.LShift, ast.RShift, ast.MatMult)):
                raise _Refused(f"a {what} with a power or shift: {source[:60]!r}")
            continue
        if isinstance(node, ast.BinOp):
            continue
        if isinstance(node, ast.Constant):
            v = node.value
            ok = (type(v) in (int, float, bool) and (type(v) is not int or abs(v) < 1 << 64)) or v is None or \
                (isinstance(v, str) and (bool(_SYMBOL.match(v)) or what == "guard" and len(v) < 64 and v.isidentifier()))
            if not ok:
                raise _Refused(f"a {what} with the constant {str(v)[:40]!r}")
            continue
        if isinstance(node, ast.Name):
            if node.id not in allowed_names and not (what == "shape expression" and _SYMBOL.match(node.id)):
                raise _Refused(f"a {what} naming {node.id!r}")
            continue
        if isinstance(node, ast.keyword):
            if what != "shape expression" or node.arg not in _SYMPY_KEYWORDS or not isinstance(node.value, ast.Constant):
                raise _Refused(f"a {what} with the keyword {node.arg!r}")
            continue
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in _POWERS:
                if any(isinstance(a, ast.Call) and isinstance(a.func, ast.Name) and a.func.id in _POWERS
                       for a in ast.walk(node) if a is not node) or _big_exponent(node):
                    raise _Refused(f"a {what} with a large power: {source[:60]!r}")
            ok = isinstance(func, ast.Name) and func.id in allowed_names or \
                isinstance(func, ast.Attribute) and func.attr in attrs
            if not ok:
                raise _Refused(f"a {what} calling {ast.unparse(func)[:40]!r}")
            continue
        if isinstance(node, ast.Attribute):
            if node.attr not in attrs or node.attr.startswith("_"):
                raise _Refused(f"a {what} reading .{node.attr}")
            continue
        if isinstance(node, ast.Subscript):
            if not isinstance(node.slice, ast.Constant):
                raise _Refused(f"a {what} with a computed subscript")
            continue
        raise _Refused(f"a {what} with {type(node).__name__}: {source[:60]!r}")


def _big_exponent(call: ast.Call) -> bool:
    exponent = call.args[1] if len(call.args) > 1 else None
    return isinstance(exponent, ast.Call) and exponent.args and isinstance(exponent.args[0], ast.Constant) and \
        isinstance(exponent.args[0].value, int) and abs(exponent.args[0].value) > 64 or \
        isinstance(exponent, ast.Constant) and isinstance(exponent.value, int) and abs(exponent.value) > 64


def check_program(program: torch.export.ExportedProgram, path: Path) -> None:
    """After deserialization: every call is a torch operator of the allowed namespaces or arithmetic."""
    import math
    import operator

    allowed = {getattr(operator, n) for n in OPERATOR_FNS} | {getattr(math, n) for n in _MATH_FNS}
    allowed |= {getattr(torch, n) for n in _TORCH_SYM_FNS if hasattr(torch, n)}
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else []:
            if node.op in ("call_module", "call_method"):
                raise UnsafeArchiveError(f"{path}: this .pt2 holds code, not only a program ({node.op} {node.target!r}); "
                                         "refusing to load it")
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
                ns, op = target.namespace, target.__name__.split(".")[0]
                ok = ns in _NAMESPACES and not does_io(ns, op) or (ns, op) in _LIBRARY_OPS
            else:
                ok = target in allowed
            if not ok:
                raise UnsafeArchiveError(f"{path}: this .pt2 holds code, not only a program (call target "
                                         f"{str(target)[:80]!r}); refusing to load it")
