"""The compiled model against its source, before the artifact is written (`compile_model`'s
`verify_outputs`, on by default; `compile --no-verify` skips it).

The source runs in onnxruntime (isolated, exact Sigmoid) or torch on the same inputs as the
built executable; every output must match within RTOL of its largest magnitude (integer and bool
outputs exactly), so a model a TVM frontend silently converted wrong is not deployed. The bound
grows as RTOL·sqrt(L / DEPTH_FREE) past DEPTH_FREE residual steps L, as rounding differences add
up like a random walk along the stream.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ...core import verify
from ...core.errors import first_line
from ...ops.depth_attention import is_attnres_op
from .importers import ImportedModel

RTOL = 1e-4  # float32: kernels and fast-math exp/tanh/erf against onnxruntime or torch (zoo: <= 2.8e-6)
DEPTH_FREE = 8  # residual steps the flat RTOL covers; deeper models get RTOL * sqrt(depth / DEPTH_FREE)


def tolerance(depth: int) -> verify.Tolerance:
    """The check's tolerance for a model of `depth` residual steps."""
    return verify.Tolerance(RTOL * max(1.0, (depth / DEPTH_FREE) ** 0.5), rounding=True)


def onnx_depth(path: Path) -> int:
    """Residual steps of an ONNX model: its residual links (chain analysis) plus its AttnRes sites."""
    import onnx

    from ...core.chain_analysis import analyze
    from ...core.config import AttnResConfig
    from ...onnx.function import DELTA, DOMAIN, MERGE, OP_TYPE
    from ...onnx.view import view_from_onnx

    model = onnx.load(os.fspath(path), load_external_data=False)
    sites = sum(n.domain == DOMAIN and n.op_type in (OP_TYPE, MERGE, DELTA) for n in model.graph.node)
    try:
        plan = analyze(view_from_onnx(model), AttnResConfig(min_chain=1))
    except Exception:  # noqa: BLE001 - a model the analysis cannot read gets the flat bound
        return sites
    return sites + sum(len(c.links) for c in plan.chains)


def program_depth(program: torch.export.ExportedProgram) -> int:
    """AttnRes sites of a program (a `.pt2` of ours); 0 for others, which get the flat bound."""
    return sum(is_attnres_op(n.target) for n in program.graph.nodes)


def source_depth(model: Any, imported: ImportedModel) -> int:
    """Residual steps of the compiled source, as `check` counts them for its bound."""
    if imported.kind == "onnx":
        return onnx_depth(Path(model))
    return program_depth(model if isinstance(model, torch.export.ExportedProgram) else _load_program(Path(model)).program)


def check(model: Any, imported: ImportedModel, executable, device, input_shapes: dict | None,
          timeout: float | None) -> dict:
    """{"reference", "inputs" (name -> shape, the first set), "verified_shapes" (every set compared),
    "rows" (verify.compare rows per output, over the sets), "notes"}, or {"skipped": reason} when
    there is nothing to compare against."""
    from ...onnx.runtime import compare_outputs, merge_rows

    notes: list[str] = []
    if imported.kind == "onnx":
        from ...onnx.runtime import verification_runs

        runs, notes = verification_runs(Path(model), None, input_shapes, timeout=timeout)
        reference, depth = "onnxruntime", onnx_depth(Path(model))
    else:
        loaded = None if isinstance(model, torch.export.ExportedProgram) else _load_program(Path(model))
        program = model if loaded is None else loaded.program
        if program.example_inputs is None:
            return {"skipped": "the program stores no example inputs"}
        args, kwargs = program.example_inputs
        module = program.module() if loaded is None else loaded.module()  # pt2.Loaded: how every command runs a .pt2
        out = verify.run(module, (args, kwargs))  # on a copy: a program that changes its inputs
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        feeds = {name: t.detach().cpu().numpy() for name, t in zip(imported.inputs, tensors)}
        expected = {name: t.detach().cpu().numpy() for name, t in
                    zip(imported.outputs, [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])}
        runs = [{"shapes": {k: v.shape for k, v in feeds.items()}, "feeds": feeds, "expected": expected}]
        reference, depth = "torch", program_depth(program)
    tol = tolerance(depth)
    if tol.rtol > RTOL:
        notes.append(f"tolerance {tol.rtol:.1e} of each output's largest magnitude: {RTOL:.0e} grown with the "
                     f"model's {depth} residual steps (sqrt({depth}/{DEPTH_FREE}))")
    per_set = []
    for r in runs:
        try:
            actual = dict(zip(imported.outputs, run(executable, device, [r["feeds"][n] for n in imported.inputs])))
            rows = compare_outputs(r["expected"], actual, tol)
        except Exception as exc:  # noqa: BLE001 - the VM's shape checks and kernels raise TVMError and others
            rows = [{"output": "TVM", "ok": False, "verdict": "fail",
                     "error": f"the compiled model fails where {reference} runs ({first_line(exc)})"}]
        per_set.append((r["shapes"], rows))
    return {"reference": reference, "inputs": {k: list(v) for k, v in runs[0]["shapes"].items()},
            "verified_shapes": [{k: list(v) for k, v in r["shapes"].items()} for r in runs],
            "rows": merge_rows(per_set), "notes": notes}


def run(executable, device, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The executable's `main` on `arrays`, its outputs flattened to numpy arrays."""
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(executable, device)
    result = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(a), device) for a in arrays])

    def flat(item) -> list[np.ndarray]:
        return [item.numpy()] if isinstance(item, tvm.runtime.Tensor) else [a for x in item for a in flat(x)]

    return flat(result)


def _load_program(path: Path):
    from ...pt2 import load

    return load(os.fspath(path))
