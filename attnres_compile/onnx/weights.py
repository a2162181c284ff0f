"""Weight-only quantized ONNX files (`rewrite --weights int8|int4`), and their verification with stated bounds.

Every MatMul whose weight is a constant 2-D initializer (a tied LM head through a transposed copy)
becomes onnxruntime's `com.microsoft.MatMulNBits` in blocks of `BLOCK` values; the sites, norms,
embedding table and activation products keep float32. A quantized model is verified against the
float32 model it was made from on language-model terms (perplexity, next-token agreement, greedy
tokens), each bound stated in the report (`BOUNDS`); a model that is not a language model
(`token_names`) is refused with verification. docs/quantize.md gives the formats and bounds.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from ..core.errors import ConfigError, ModelRunError, VerificationError
from ..core.report import describe_check
from ..utils import isolate

BITS = {"int8": 8, "int4": 4}
BLOCK = 32
# onnxruntime's MatMulNBits computes in int8 at accuracy_level 4 (the activations quantized per block at run
# time, as llama.cpp's quantized dot products do): 0.053 against 0.18 ms for a 576 x 1536 4-bit GEMV at level 0,
# and 0.057 against 2.5 ms at 8 bits (level 0 dequantizes the whole weight per call), 1 thread, this machine.
ACCURACY = 4
# The LM head keeps 8 bits in an int4 file, as llama.cpp's 4-bit types keep their output tensor at 6 or 8 bits:
# SmolLM2's vocabulary projection at 4 bits alone raised its perplexity by tens of percent.
HEAD_BITS = {"int8": 8, "int4": 8}
GREEDY = 8


@dataclass(frozen=True)
class Bounds:
    """What a quantized model may differ by from its float32 model (see the module docstring)."""

    perplexity: float  # relative increase allowed
    agreement: float  # least share of next-token top-1 predictions equal to the float32 model's


# Measured on SmolLM2-135M, 4 rows x 128 tokens of pydoc text (benchmarks/runs/2026-12-07-serve): int8 +0.54%
# perplexity, 95.9% agreement; int4 +0.44%, 94.9% (llama.cpp on the same rows: Q8_0 +0.68%, 96.5%; Q4_1 +0.84%,
# 94.9%; Q4_0, symmetric 4 bits, +34%, 68.7%, as our symmetric int4 was: +42%). The bounds leave room for
# short rows (30 predictions: one flip is 3.3%).
BOUNDS = {"int8": Bounds(perplexity=0.02, agreement=0.90), "int4": Bounds(perplexity=0.05, agreement=0.85)}


def check_weights(weights: str | None) -> None:
    if weights is not None and weights not in BITS:
        raise ConfigError(f"weights must be one of {', '.join(BITS)}, got {weights!r}")


def quantize(model: onnx.ModelProto, weights: str, block_size: int = BLOCK, accuracy_level: int | None = ACCURACY,
             minimum: bool | None = None, head_bits: int | None = None) -> tuple[onnx.ModelProto, dict]:
    """`model` (weights loaded) with every constant-weight MatMul as MatMulNBits, and a summary dict
    ("method", "bits", "block_size", "minimum", "accuracy_level", "quantized", "kept", "head_bits",
    "bytes_before", "bytes_after"). int8: Q8_0-like symmetric blocks; int4: `with_minimum` (Q4_1),
    or symmetric (Q4_0) with `minimum=False`. The LM head gets `head_bits`."""
    import logging

    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    check_weights(weights)
    minimum = weights == "int4" if minimum is None else minimum and weights == "int4"
    head_bits = HEAD_BITS[weights] if head_bits is None else head_bits
    before = _initializer_bytes(model)
    transposed = _constant_transposes(model)
    for k, n in enumerate(model.graph.node):
        if n.op_type == "MatMul" and not n.name:
            n.name = f"attnres_matmul_{k}"
    matmuls = sum(n.op_type == "MatMul" for n in _nodes(model.graph))
    head = _head(model) if head_bits != BITS[weights] else None
    body = with_minimum(model, block_size, (head,) if head else (), accuracy_level) if minimum else 0
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs a line per MatMul
    try:
        passes = [] if minimum else [(BITS[weights], {"nodes_to_exclude": [head] if head else []})]
        if head:  # the quantizer takes every MatMul beside those it is told to include: exclude them
            others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name != head]
            passes.append((head_bits, {"nodes_to_exclude": others}))
        for bits, which in passes:
            quantizer = nbits.MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True,
                                                   accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",),
                                                   **which)
            quantizer.process()
            model = quantizer.model.model
    finally:
        logger.setLevel(level)
    quantized = sum(n.op_type == "MatMulNBits" for n in _nodes(model.graph))
    return model, {"method": "onnxruntime MatMulNBits", "bits": BITS[weights], "block_size": block_size,
                   "minimum": minimum, "accuracy_level": accuracy_level, "quantized": quantized,
                   "kept": matmuls - quantized, "transposed": transposed, "head_bits": head_bits if head else None,
                   "with_minimum": body, "bytes_before": before, "bytes_after": _initializer_bytes(model)}


def with_minimum(model: onnx.ModelProto, block_size: int = BLOCK, exclude: tuple[str, ...] = (),
                 accuracy_level: int | None = None) -> int:
    """Every MatMul with a constant [K, N] weight (K a multiple of `block_size`, not in `exclude`) as
    4-bit blocks with a float32 minimum (llama.cpp's Q4_1: d = (max - min) / 15, w = d * q + min).
    onnxruntime's fast MatMulNBits kernels take integer zero points only, so the node is the
    symmetric MatMulNBits d * (q - 8) plus the minimum's part, `x @ S @ M` (S the block indicator).
    In place; returns how many MatMuls."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    sums: dict[tuple[str, int], str] = {}
    done, nodes = 0, []
    for node in graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.dims[0] % block_size or node.name in exclude \
                or w.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        k, n = w.dims
        blocks = k // block_size
        wt = numpy_helper.to_array(w).astype(np.float32).T.reshape(n, blocks, block_size)
        low, high = wt.min(-1), wt.max(-1)
        d = (high - low) / 15
        d = np.where(d > 0, d, 1.0).astype(np.float32)
        q = np.clip(np.rint((wt - low[..., None]) / d[..., None]), 0, 15).astype(np.uint8)
        blob = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        base = f"{node.name or node.output[0]}.q4"
        key = (node.input[0], k)
        new = [numpy_helper.from_array(blob, f"{base}.B"), numpy_helper.from_array(d.reshape(-1), f"{base}.scales"),
               numpy_helper.from_array((low + 8 * d).T.astype(np.float32).copy(), f"{base}.minimum")]
        if key not in sums:
            indicator = np.repeat(np.eye(blocks, dtype=np.float32), block_size, axis=0)
            new.append(numpy_helper.from_array(indicator, f"{base}.blocks"))
            sums[key] = f"{base}.block_sums"
            nodes.append(helper.make_node("MatMul", [node.input[0], f"{base}.blocks"], [sums[key]],
                                          name=f"{base}.block_sums"))
        graph.initializer.extend(new)
        nodes += [helper.make_node("MatMulNBits", [node.input[0], f"{base}.B", f"{base}.scales"], [f"{base}.main"],
                                   name=f"{base}.main", domain="com.microsoft", K=k, N=n, bits=4,
                                   block_size=block_size,
                                   **({} if accuracy_level is None else {"accuracy_level": accuracy_level})),
                  helper.make_node("MatMul", [sums[key], f"{base}.minimum"], [f"{base}.offset"], name=f"{base}.offset"),
                  helper.make_node("Add", [f"{base}.main", f"{base}.offset"], [node.output[0]], name=f"{base}.add")]
        done += 1
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        used = {i for n in graph.node for i in n.input}
        keep = [t for t in graph.initializer if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(keep)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return done


def _head(model: onnx.ModelProto) -> str | None:
    """The name of the LM head: the MatMul whose output is a graph output (through at most a bias Add), named
    here when it has no name."""
    outputs = {o.name for o in model.graph.output}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    for n in model.graph.node:
        if n.op_type != "MatMul":
            continue
        after = readers.get(n.output[0], [])
        if n.output[0] in outputs or (len(after) == 1 and after[0].op_type == "Add" and after[0].output[0] in outputs):
            n.name = n.name or "attnres_lm_head"
            return n.name
    return None


def _constant_transposes(model: onnx.ModelProto) -> int:
    """MatMul(x, Transpose(W)) with W a 2-D initializer (a tied LM head: torch.onnx writes `x @ W^T` so, the
    embedding's Gather reading W too) gets W^T as an initializer of its own, which the quantizer takes; the
    Transpose goes where nothing else reads it. Returns how many."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in graph.node:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    made: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        t = producers.get(node.input[1])
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits or len(inits[t.input[0]].dims) != 2:
            continue
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), [1, 0])
        if perm != [1, 0]:
            continue
        if t.output[0] not in made:
            name = f"{t.input[0]}.transposed"
            graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(inits[t.input[0]]).T.copy(), name))
            made[t.output[0]] = name
        node.input[1] = made[t.output[0]]
        readers[t.output[0]] -= 1
    for out in made:
        if readers[out] == 0 and out not in {o.name for o in graph.output}:
            graph.node.remove(producers[out])
    return len(made)


def _nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from _nodes(g)


def _initializer_bytes(model: onnx.ModelProto) -> int:
    total = 0
    for t in model.graph.initializer:
        size = next((int(e.value) for e in t.external_data if e.key == "length"), None)
        total += size if size is not None else len(t.raw_data) or math.prod(t.dims) * _itemsize(t.data_type)
    return total


def _itemsize(data_type: int) -> int:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except (KeyError, TypeError):
        return 4


# ---------------------------------------------------------------- verification

INTEGER = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


def token_names(model: onnx.ModelProto) -> tuple[str, str] | str:
    """(token ids input, logits output) of a language model: the integer input `input_ids` (else the only
    integer input) and the output `logits` (else the only output); or why `model` is not one."""
    ints = [i.name for i in model.graph.input if i.type.tensor_type.elem_type in INTEGER
            and i.name not in ("attention_mask", "position_ids")]
    ids = "input_ids" if "input_ids" in ints else ints[0] if len(ints) == 1 else None
    outputs = [o.name for o in model.graph.output]
    logits = "logits" if "logits" in outputs else outputs[0] if len(outputs) == 1 else None
    if ids is None:
        return "it has no integer input_ids input"
    if logits is None:
        return "it has no logits output"
    return ids, logits


def _feeds(session, ids: list[int], name: str, dtype) -> dict[str, np.ndarray]:
    """One row from an empty past: the token ids (input `name`), a mask of ones, positions, and every past_*
    input with length 0 (its static dims as declared)."""
    n = len(ids)
    feeds = {}
    for i in session.get_inputs():
        if i.name == name:
            feeds[i.name] = np.asarray([ids], dtype)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, n), np.int64 if "int64" in i.type else np.int32)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(n, dtype=np.int64)[None]
        elif i.name.startswith("past"):
            dims = [1 if k == 0 else (d if isinstance(d, int) else 0) for k, d in enumerate(i.shape)]
            if len(dims) == 4:
                dims[2] = 0
            feeds[i.name] = np.zeros(dims, np.float16 if "float16" in i.type else np.float32)
        else:
            raise ModelRunError(f"cannot evaluate the quantized model: it takes an input {i.name!r} the "
                                "language-model evaluation does not feed (input_ids, attention_mask, position_ids, "
                                "past_*)")
    return feeds


def _evaluate_in_child(reference: str, quantized: str, rows: list[list[int]], greedy: int,
                       names: tuple[str, str]) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    sessions = [ort.InferenceSession(p, options, providers=["CPUExecutionProvider"]) for p in (reference, quantized)]
    ids_name, logits_name = names
    dtype = np.int64 if "int64" in next(i.type for i in sessions[0].get_inputs() if i.name == ids_name) else np.int32

    def logits(session, ids):
        out = session.run([logits_name], _feeds(session, ids, ids_name, dtype))[0]
        return out[0].astype(np.float64)

    nll, agree, count, greedy_rows = [0.0, 0.0], 0, 0, []
    for row in rows:
        outs = [logits(s, row) for s in sessions]
        targets = np.asarray(row[1:])
        for k, out in enumerate(outs):
            z = out[:-1]
            z = z - z.max(axis=1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            nll[k] -= float(logp[np.arange(len(targets)), targets].sum())
        agree += int((outs[0][:-1].argmax(1) == outs[1][:-1].argmax(1)).sum())
        count += len(targets)
        prompt = row[:max(1, len(row) // 2)]
        made = []
        for session in sessions:
            ids = list(prompt)
            for _ in range(greedy):
                ids.append(int(logits(session, ids)[-1].argmax()))
            made.append(ids[len(prompt):])
        same = [a == b for a, b in zip(*made)]
        greedy_rows.append({"equal": sum(same), "first_difference": same.index(False) if False in same else None})
    return {"perplexity": [math.exp(v / count) for v in nll], "agreement": agree / count, "positions": count,
            "greedy": greedy_rows}


def evaluate(reference: str | os.PathLike, quantized: str | os.PathLike, rows: np.ndarray, weights: str,
             names: tuple[str, str], timeout: float | None = None, bounds: Bounds | None = None,
             source: str = "") -> dict:
    """The quantized model against its float32 `reference` on `rows` ([rows, tokens] of token ids), in an
    onnxruntime child: {"bounds", "rows": [...], "ok"} (module docstring). `source` names the rows."""
    from .runtime import default_timeout

    bounds = bounds or BOUNDS[weights]
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 2 or not np.issubdtype(rows.dtype, np.integer):
        raise ConfigError(f"the evaluation rows must be token ids of shape [rows, tokens >= 2], got {rows.dtype} "
                          f"{list(rows.shape)}")
    try:
        got = isolate.run(_evaluate_in_child, str(reference), str(quantized), rows.tolist(), GREEDY, tuple(names),
                          what="onnxruntime", action="evaluating the quantized weights",
                          timeout=timeout or 4 * default_timeout(quantized), consequence="nothing written",
                          hint="Re-run with verify_outputs=False to skip verification")
    except isolate.ChildError as exc:
        raise ModelRunError(str(exc)) from None
    fp32, quant = got["perplexity"]
    change = quant / fp32 - 1
    checks = [
        {"check": "perplexity", "fp32": fp32, "quantized": quant, "change": change,
         "bound": f"<= +{bounds.perplexity:.0%}", "ok": bool(change <= bounds.perplexity)},
        {"check": "next-token agreement", "value": got["agreement"], "bound": f">= {bounds.agreement:.0%}",
         "ok": bool(got["agreement"] >= bounds.agreement)},
        {"check": f"greedy tokens ({GREEDY} after each row's first half)", "rows": got["greedy"], "tokens": GREEDY,
         "bound": None, "ok": None},
    ]
    return {"rows_evaluated": list(rows.shape), "positions": got["positions"], "source": source,
            "bounds": asdict(bounds), "checks": checks, "ok": all(c["ok"] is not False for c in checks)}


def judge(info: dict) -> None:
    """VerificationError when a bounded check failed."""
    check = info.get("verification")
    if check and not check["ok"]:
        failed = next(c for c in check["checks"] if c["ok"] is False)
        raise VerificationError(f"the {info['weights']} weights are out of bounds: {describe_check(failed)[2:]}; "
                                "nothing written")


def read_eval_ids(path: str | os.PathLike) -> np.ndarray:
    """`--eval-ids FILE.npy`: token ids [rows, tokens] (a 1-D array is one row)."""
    try:
        ids = np.load(Path(path), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--eval-ids {path}: not a readable .npy array of token ids ({exc})") from None
    return ids[None] if ids.ndim == 1 else ids
