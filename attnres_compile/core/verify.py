"""Numerical verification: original against rewritten outputs on the same inputs, per output.

Every element must satisfy |got - ref| <= rtol * (max|ref| + |ref|), rtol following the mode and
dtype (`min_rtol` reported); NaN/inf at the same positions; fp16/bf16 also pass within twice the
original's error against a float64 `truth`; tiny, empty, integer and bool outputs as the rows
say. `verify_module` runs each model on fresh input copies, restores the caller's buffers and RNG
state, and runs once more with zero rows (`zero_rows`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

PRESERVE_RTOL = 1e-5   # float32, preserve mode: ~80 ulps of rounding, relative to the output's magnitude
PAPER_RTOL = 1e-3      # paper mode on PreNorm models differs through the norms' eps only
TRAINED_RTOL = 1e-4    # an export of trained sites: non-uniform depth weights compound rounding over the layers
LOW_PRECISION_RTOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}  # 4 ulps (fp16/bf16 differ by ~1 ulp when exact)
TRUTH_FACTOR = 2.0     # fp16/bf16: the rewrite's error against float64 may be up to twice the original's
TINY = math.sqrt(torch.finfo(torch.float32).tiny)  # 1.1e-19


def output_name(path: tuple) -> str:
    """A pytree leaf's path as a name: `logits`, `hidden_states.1`, `0` (not `['logits']`)."""
    parts = []
    for key in path:
        if isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, pytree.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, pytree.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(key).strip(".[]'\""))
    return ".".join(parts) or "output"


@dataclass(frozen=True)
class Tolerance:
    """`rtol` at float32; `rounding`: differences are rounding only, so rtol scales with the dtype's epsilon."""

    rtol: float
    rounding: bool

    def rtol_for(self, dtype: torch.dtype) -> float:
        if dtype in LOW_PRECISION_RTOL:
            return max(self.rtol, LOW_PRECISION_RTOL[dtype])
        if self.rounding and dtype == torch.float64:
            return self.rtol * torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
        return self.rtol


def tolerance(scale: str, changes_function: bool) -> Tolerance | None:
    """The verdict's tolerance for a rewrite: none (None) when it changes the function."""
    if changes_function:
        return None
    if scale == "preserve":
        return Tolerance(PRESERVE_RTOL, rounding=True)
    return Tolerance(PAPER_RTOL, rounding=False)


def has_trained_sites(module) -> bool:
    """Whether `module` holds AttnRes parameters (`attnres.*`: queries, Delta's gates) that are not all
    zero, the exact starting point: its export is then checked at TRAINED_RTOL."""
    return any(is_attnres_param(name) and bool(p.detach().any()) for name, p in module.named_parameters())


def is_attnres_param(name: str) -> bool:
    """Whether parameter `name` (as `named_parameters` gives it) is a rewrite's query or gate (`attnres.*`)."""
    return name.startswith("attnres.") or ".attnres." in name


def compare(expected: Any, actual: Any, tol: Tolerance | None, truth: Any = None) -> list[dict]:
    """One row per tensor output leaf: errors, the tolerance, `min_rtol` and the verdict ("pass",
    "fail", "too small", "empty" or "none"; "ok" True/False on pass/fail). `tol=None`: no verdict
    (the rewrite changes the function). `truth`: a float64 run's outputs, for fp16/bf16.
    """
    exp_leaves, _ = pytree.tree_flatten_with_path(expected)
    act_leaves, _ = pytree.tree_flatten_with_path(actual)
    if len(exp_leaves) != len(act_leaves):
        return [{"output": "<structure>", "ok": False, "verdict": "fail",
                 "error": f"{len(exp_leaves)} outputs before, {len(act_leaves)} after"}]
    truth_leaves = pytree.tree_leaves(truth) if truth is not None else []
    if len(truth_leaves) != len(exp_leaves):
        truth_leaves = [None] * len(exp_leaves)
    rows = []
    for (path, ref), (_, got), true in zip(exp_leaves, act_leaves, truth_leaves):
        if not isinstance(ref, torch.Tensor):
            continue
        name = output_name(path)
        if not isinstance(got, torch.Tensor) or got.shape != ref.shape:
            shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            rows.append({"output": name, "ok": False, "verdict": "fail", "error": f"shape {list(ref.shape)} became {shape}"})
        elif not ref.numel():
            rows.append({"output": name, "shape": list(ref.shape), "dtype": _dtype(ref), "verdict": "empty"})
        elif not ref.is_floating_point():
            rows.append({"output": name, **_compare_exact(ref, got, tol)})
        else:
            rows.append({"output": name, **_compare_tensor(ref, got, tol, true if isinstance(true, torch.Tensor) else None)})
    return rows


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _compare_exact(ref: torch.Tensor, got: torch.Tensor, tol: Tolerance | None) -> dict:
    """The row fields for an integer or bool output: equal everywhere, or the count that differ."""
    row = {"shape": list(ref.shape), "dtype": _dtype(ref), "exact": True}
    if got.is_floating_point() or got.is_complex():
        row["mismatch"] = ref.numel()
        differ = f"{_dtype(ref)} became {_dtype(got)}"
    else:
        row["mismatch"] = int((ref.detach().cpu().long() != got.detach().cpu().long()).sum())
        differ = f"{row['mismatch']} of {ref.numel()} values differ (compared exactly)"
    if tol is None:
        row["verdict"] = "none"
    elif row["mismatch"]:
        row["verdict"], row["ok"], row["error"] = "fail", False, f"{_dtype(ref)}{list(ref.shape)}: {differ}"
    else:
        row["verdict"], row["ok"] = "pass", True
    return row


def _compare_tensor(ref: torch.Tensor, got: torch.Tensor, tol: Tolerance | None, truth: torch.Tensor | None = None) -> dict:
    """The row fields (without "output") for one pair of same-shaped floating tensors."""
    ref64, got64 = ref.detach().double(), got.detach().double()
    finite_ref, finite_got = torch.isfinite(ref64), torch.isfinite(got64)
    both = finite_ref & finite_got
    mismatch = int(((~finite_ref | ~finite_got) & ~_same_nonfinite(ref64, got64)).sum())
    r, g = ref64[both], got64[both]
    diff = (r - g).abs()
    scale = r.abs().max().item() if r.numel() else 0.0
    max_abs = diff.max().item() if diff.numel() else 0.0
    row = {"shape": list(ref.shape), "dtype": _dtype(ref), "max_abs": max_abs,
           "max_rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf), "ref_max": scale,
           "min_rtol": _min_rtol(diff, r.abs(), scale)}
    if mismatch:
        row["nonfinite_mismatch"] = mismatch
    nonfinite = int((~finite_ref).sum())
    if nonfinite:
        row["nonfinite"] = nonfinite
    if tol is None:
        row["verdict"] = "none"
        return row
    rtol = tol.rtol_for(ref.dtype)
    row["rtol"], row["atol"] = rtol, rtol * scale
    passed = not mismatch and row["min_rtol"] <= rtol
    if truth is not None and ref.dtype in LOW_PRECISION_RTOL and not mismatch:
        passed = _against_truth(row, ref64, got64, truth.detach().double(), both) or passed
    if passed and r.numel() and scale < TINY:
        row["verdict"] = "too small"
        return row
    row["verdict"] = "pass" if passed else "fail"
    row["ok"] = passed
    return row


def _same_nonfinite(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where `a` and `b` hold the same non-finite value (both NaN, or the same infinity)."""
    return (torch.isnan(a) & torch.isnan(b)) | (torch.isinf(a) & (a == b))


def _min_rtol(diff: torch.Tensor, ref_abs: torch.Tensor, scale: float) -> float:
    """The smallest rtol with |diff| <= rtol * (max|ref| + |ref|) everywhere (atol = rtol * max|ref|)."""
    if not diff.numel() or diff.max().item() == 0:
        return 0.0
    if scale == 0:
        return math.inf
    return (diff / (scale + ref_abs)).max().item()


def _against_truth(row: dict, ref64, got64, truth64, both) -> bool:
    """fp16/bf16: record both models' errors against the float64 run; True when the rewrite's is within TRUTH_FACTOR x the original's."""
    if truth64.shape != ref64.shape:
        return False
    mask = both & torch.isfinite(truth64)
    if not mask.any():
        return False
    t = truth64[mask]
    orig_err = (ref64[mask] - t).abs().max().item()
    new_err = (got64[mask] - t).abs().max().item()
    row["truth_err_original"], row["truth_err_rewritten"] = orig_err, new_err
    return new_err <= TRUTH_FACTOR * orig_err


def paper_scale_note(failed: int) -> str:
    """Why a `scale="paper"` rewrite's check fails on `failed` outputs: the paper's scaling is exact only up to the norms' eps."""
    return (f"paper scale differs from the original on {failed} output(s); it is exact only up to the norms' eps on "
            "PreNorm models (not an error)")


def refuse_failed(rows: list[dict] | None, scale: str) -> None:
    """VerificationError when a check that must pass failed: raised before anything is committed, so a
    failed verification writes nothing. Paper scale differs by design (paper_scale_note)."""
    from .errors import VerificationError

    failed = [r for r in rows or [] if r.get("ok") is False]
    if not failed or scale == "paper":
        return
    message = (f"{scale}-mode verification failed on {len(failed)} output(s), e.g. "
               f"{' '.join(describe(failed[0]).split()[1:])}")
    if "original_export" in failed[0]:
        message += ("; the original model, exported to ONNX the same way, fails that check too "
                    f"({' '.join(failed[0]['original_export'].split()[2:])}): the ONNX export or onnxruntime "
                    "computes this model wrongly, not the rewrite; -o X.pt2 keeps it in PyTorch")
    raise VerificationError(message + "; nothing written")


def describe(row: dict) -> str:
    """One line for a row: mark, output, errors, tolerance and the minimum rtol that would pass."""
    edge = _zero_rows_text(row)
    if "error" in row:
        return f"✗ {row['output']}: {row['error']}{edge}"
    mark = {"pass": "✓", "fail": "✗", "too small": "?", "none": "·", "empty": "∅"}[row["verdict"]]
    if row["verdict"] == "empty":
        return f"{mark} {row['output']:<28} {row['dtype']}{row['shape']}: no values, nothing compared{edge}"
    if row.get("exact"):
        text = f"{mark} {row['output']:<28} {row['dtype']}{row['shape']}: "
        return text + (f"{row['mismatch']} values differ" if row["mismatch"] else "all equal") + \
            ("  (function changed: no verdict)" if row["verdict"] == "none" else "  (compared exactly)") + edge
    text = f"{mark} {row['output']:<28} max abs {row['max_abs']:.2e}  max rel {row['max_rel']:.2e}"
    if row.get("nonfinite_mismatch"):
        text += f"  non-finite values differ at {row['nonfinite_mismatch']} positions"
    elif row.get("nonfinite"):
        text += f"  ({row['nonfinite']} non-finite, identical)"
    if "truth_err_original" in row:
        text += f"  vs float64: original {row['truth_err_original']:.1e}, rewritten {row['truth_err_rewritten']:.1e}"
    if row["verdict"] == "none":
        return text + "  (function changed: no tolerance)"
    text += f"  rtol {row['rtol']:.1e}"
    if not row.get("nonfinite_mismatch"):
        text += f" (passes from {row['min_rtol']:.1e})"
    if row["verdict"] == "too small":
        text += f"  too small to tell: max |ref| {row['ref_max']:.1e} < {TINY:.1e}"
    return text + edge


def nothing_compared(rows: list[dict]) -> str | None:
    """Why no value was compared when none was (every output empty, or none a tensor), else None."""
    if all(r.get("verdict") == "empty" for r in rows):
        return "nothing was compared: " + ("every output is empty" if rows else "the model has no tensor outputs")
    return None


def _zero_rows_text(row: dict) -> str:
    """"  with zero rows in x: ..." when the zero-row run failed this output, else ""."""
    edge = row.get("zero_rows")
    if not edge or edge["verdict"] != "fail":
        return ""
    what = edge.get("error") or (f"non-finite values differ at {edge['nonfinite_mismatch']} positions"
                                 if edge.get("nonfinite_mismatch") else f"max rel {edge['max_rel']:.2e}, passes from "
                                 f"{edge['min_rtol']:.1e}")
    return f"  with zero rows in {', '.join(edge['inputs'])}: {what}"


def needs_truth(outputs: Any) -> bool:
    """Whether any floating output is fp16/bf16 (verified against a float64 run of the original)."""
    return any(isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION_RTOL for t in pytree.tree_leaves(outputs))


def fresh(inputs: Any) -> Any:
    """A deep copy of `inputs` (tensors and containers such as a KV cache): what one run changes
    in place, no other run sees."""
    try:
        return copy.deepcopy(inputs)
    except Exception:  # noqa: BLE001 - a non-leaf tensor refuses deepcopy: its value is what counts
        return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), inputs)


@contextlib.contextmanager
def kept(*modules: Any):
    """Restore, on exit, the buffers of `modules` (train-mode BatchNorm's running statistics) and
    the torch RNG state (CPU, and CUDA when initialised), as they were on entry."""
    buffers = [(m, name, t, t.detach().clone()) for module in modules if isinstance(module, torch.nn.Module)
               for m in module.modules() for name, t in m._buffers.items() if t is not None]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        with torch.no_grad():
            for m, name, t, saved in buffers:
                m._buffers[name] = t
                if not torch.equal(t, saved):
                    t.copy_(saved)


def run(module: Callable, inputs: tuple[tuple, dict]) -> Any:
    """`module`'s outputs on a fresh copy of (args, kwargs), without gradients, its buffers and the
    RNG state restored afterwards: every run starts where the first did."""
    args, kwargs = fresh(inputs)
    with kept(module), torch.no_grad():
        return module(*args, **kwargs)


def truth_run(original: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[Any, str | None]:
    """The original's outputs in float64 (else float32) on the same inputs, cast from theirs; (None, reason) if neither runs."""
    reason = None
    for dtype in (torch.float64, torch.float32):
        try:
            model = copy.deepcopy(original).to(dtype)
            cast = pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
            return run(model, cast), None
        except Exception as exc:  # noqa: BLE001 - a model that cannot run in float64 is compared by tolerance only
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return None, reason


def zero_rows(inputs: Any) -> tuple[Any, list[str]]:
    """A copy of `inputs` whose non-empty floating tensors (torch or numpy) have a zero row along each
    axis through their first element (so along the feature axis, whichever it is), and the names of
    those inputs ([]: none is floating, e.g. token ids)."""
    copied = fresh(inputs)
    names = []
    for path, t in pytree.tree_flatten_with_path(copied)[0]:
        floating = t.is_floating_point() if isinstance(t, torch.Tensor) else \
            getattr(getattr(t, "dtype", None), "kind", "") == "f"
        if not floating or not t.ndim or not all(t.shape):
            continue
        with torch.no_grad():
            for axis in range(t.ndim):
                t[(0,) * axis + (slice(None),) + (0,) * (t.ndim - axis - 1)] = 0
        names.append(_input_name(path))
    return copied, names


def _input_name(path: tuple) -> str:
    """An input's name from its path in (args, kwargs) (`arg0`, `pixel_values`) or in a feeds dict."""
    if len(path) > 1 and isinstance(path[0], pytree.SequenceKey) and path[0].idx == 0:
        return f"arg{output_name(path[1:])}"
    return output_name(path[1:] if len(path) > 1 and isinstance(path[0], pytree.SequenceKey) else path)


def fold_zero_rows(rows: list[dict], edge_rows: list[dict], inputs: list[str]) -> list[dict]:
    """Each row of `rows` gains "zero_rows", its output's verdict on the zero-row copy of the inputs
    (named `inputs`); a failure there fails the row. Returns `rows`."""
    edges = {r["output"]: r for r in edge_rows}
    for row in rows:
        edge = edges.get(row["output"])
        if edge is None or row["verdict"] == "empty":  # an empty output's failing edge gets a row of its own
            continue
        del edges[row["output"]]
        kept_fields = ("verdict", "error", "max_abs", "max_rel", "min_rtol", "nonfinite_mismatch")
        row["zero_rows"] = {"inputs": inputs, **{k: edge[k] for k in kept_fields if k in edge}}
        if edge.get("ok") is False and row["verdict"] != "none":
            row["verdict"], row["ok"] = "fail", False
    rows += [{**edge, "output": f"{name} (zero rows in {', '.join(inputs)})"} for name, edge in edges.items()
             if edge.get("ok") is False]
    return rows


def verify_module(original: Callable, rewritten: Callable, args: tuple, kwargs: dict,
                  tol: Tolerance | None) -> tuple[list[dict], list[str]]:
    """(rows, notes): `rewritten` against `original` on the example inputs, and on their zero-row
    copy where one exists and there is a verdict (`fold_zero_rows`); fp16/bf16 outputs also against
    a float64 run."""
    notes: list[str] = []

    def rows_for(inputs: tuple[tuple, dict]) -> list[dict]:
        expected, actual = run(original, inputs), run(rewritten, inputs)
        truth = None
        if needs_truth(expected):
            truth, failed = truth_run(original, *inputs)
            note = f"no float64 run of the original ({failed}): fp16/bf16 outputs judged by tolerance only"
            notes.extend([note] if failed and note not in notes else [])
        return compare(expected, actual, tol, truth)

    rows = rows_for((args, kwargs))
    zeroed, names = zero_rows((args, kwargs)) if tol is not None else (None, [])
    return (fold_zero_rows(rows, rows_for(zeroed), names) if names else rows), notes
