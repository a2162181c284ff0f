"""The ONNX side of the API: inspect and rewrite ONNX files, export PyTorch models to AttnRes ONNX,
with api.py's analysis, report and verdicts, verified in onnxruntime.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..core import verify
from ..core.chain_analysis import analyze
from ..core.checks import as_config, has_work, plan_notes, split_inputs
from ..core.config import AttnResConfig
from ..core.errors import AttnResError, ConfigError, ModelRunError, TraceError, first_line
from ..core.report import ExportResult, Report, build
from ..fx.pipeline import NOT_REWRITTEN, rewrite
from ..utils import outputs, progress, pytree_warning
from . import contrib_ops as onnx_contrib_ops
from . import genai as onnx_genai
from . import io as onnx_io
from . import passes
from . import queries as onnx_queries
from .function import default_opset
from .passes import FINALIZE, FuseNorms, RewriteSites, UnfuseSkipNorms
from .view import view_from_onnx


def _notes(model, path: Path) -> list[str]:
    producer = " ".join(p for p in (model.producer_name, model.producer_version) if p) or "unknown producer"
    old = onnx_io.converted_from(model)
    opset = f"opset {old}, converted to {default_opset(model)} on reading" if old else f"opset {default_opset(model)}"
    notes = [f"{path.name}: {producer}, {opset}, IR version {model.ir_version}"]
    ort_ops = onnx_io.ort_only_ops(model)
    if ort_ops:
        notes.append(f"default-domain op(s) that onnx does not define and onnxruntime runs: {', '.join(ort_ops)} "
                     "(checked against onnxruntime's schemas)")
    return notes


def inspect_onnx(path: str | os.PathLike, config: AttnResConfig | None = None,
                 input_shapes: dict[str, tuple[int, ...]] | None = None) -> Report:
    """Analyse the ONNX file at `path`: chains, links, sources, sites and skipped adds (no rewrite),
    with the inputs of `input_shapes` bound to those shapes (`_view`)."""
    config = as_config(config)
    path = Path(path)
    model = onnx_io.load(path, with_data=False)
    analysis = _Analysis(model, path, config, input_shapes)
    return build(analysis.plan, analysis.view, config, "onnx", notes=analysis.notes, extra=analysis.fused_ops)


class _Analysis:
    """An ONNX model read for the rewrite: onnxruntime's fused residual norms unfused first (their sums are
    residual adds), its view and plan, how each contrib op was read, and the notes on all of it."""

    def __init__(self, model, path: Path, config: AttnResConfig, input_shapes):
        self.notes = _notes(model, path)
        unfuse = UnfuseSkipNorms()
        self.passes = passes.run(model, [unfuse])
        self.notes += unfuse.unfused.notes()
        self.view = _view(model, input_shapes)
        self.plan = analyze(self.view, config)
        contrib = onnx_contrib_ops.contrib_ops(model, unfuse.unfused, {c.root: c.index for c in self.plan.chains})
        self.notes += onnx_contrib_ops.notes(contrib) + _analysis_notes(self.plan, self.view, input_shapes)
        self.fused_ops = {"unfused": unfuse.unfused.counts, "contrib_ops": contrib}


def _view(model, input_shapes: dict[str, tuple[int, ...]] | None):
    """The model's view, its shapes inferred with the inputs of `input_shapes` bound: sizes that shape
    inference cannot relate symbolically (`unk__12` vs `unk__18`) are compared at those shapes.
    The shapes are checked against the model's inputs first (ConfigError)."""
    from . import dims as onnx_dims

    if input_shapes:
        onnx_dims.Dims(onnx_dims.declared(model), input_shapes)
    return view_from_onnx(model, input_shapes)


def _analysis_notes(plan, view, input_shapes) -> list[str]:
    """plan_notes, and without `input_shapes` a hint where adds were skipped for symbolic dims that
    shape inference could not prove equal."""
    unproven = [s for s in plan.skipped_adds if s.reason.startswith("skip shape")
                and any(not isinstance(d, int) for d in view.nodes[s.node]["shape"] or ())]
    hint = (f"{len(unproven)} add(s) skipped because shape inference cannot prove their operands' dims equal "
            f"(e.g. {unproven[0].node}); --input-shape NAME:1x3x224x224 analyses the model at given input shapes"
            if unproven and not input_shapes else None)
    return plan_notes(plan) + ([hint] if hint else [])


def rewrite_onnx(path: str | os.PathLike, output: str | os.PathLike, config: AttnResConfig | None = None,
                 verify_outputs: bool = True, input_shapes: dict[str, tuple[int, ...]] | None = None,
                 force: bool = False, verify_timeout: float | None = None, fuse_norms: bool = False,
                 queries: dict | None = None, queries_from: str = "the checkpoint", rewrite_chains: bool = True,
                 weights: str | None = None, eval_ids=None) -> ExportResult:
    """Rewrite the ONNX file at `path` to AttnRes and write it to `output` (atomically).

    Weights stay external (`<output>.data`) when the input kept them external, or when large. With
    `verify_outputs`, the staged output and the input run in onnxruntime (an isolated child,
    `verify_timeout` seconds) at the default and all-1 shape sets (onnx/dims.py; `input_shapes`
    fixes shapes there and in the analysis); preserve mode must match to 1e-5 (else VerificationError,
    nothing written). An output that exists or would replace a file of the input needs `force`.
    `fuse_norms`: onnx/site_norm.py. `queries`
    ({"chain<i>.site<k>": array}, `queries_from` naming it in errors) are set after verification
    (onnx/queries.py). `rewrite_chains=False` writes the original through every other pass, to
    compare like with like. `weights` ("int8", "int4") quantizes MatMul weights (onnx/weights.py),
    verified on `eval_ids` (token ids [rows, tokens]).
    """
    config = as_config(config)
    path, output = Path(path), Path(output)
    _check_weights(weights, eval_ids, verify_outputs, "an ONNX file")
    model = onnx_io.load(path, with_data=False)
    carried = onnx_genai.carried(path, output)  # a genai folder's config is checked now, with the outputs
    outputs.check([*outputs.onnx_outputs(output), *(outputs.Output(dst, f"output's {dst.name}")
                                                    for dst in carried.destinations)],
                  onnx_io.input_files(model, path), force)
    with progress.stage(f"analysing {path.name}"):
        analysis = _Analysis(model, path, config, input_shapes)
    plan, view, notes = analysis.plan, analysis.view, analysis.notes
    new_sites = rewrite_chains and has_work(plan, config)
    if not rewrite_chains:
        notes.append(NOT_REWRITTEN)
    elif not new_sites and weights and queries is None:  # already rewritten: its sites kept, its weights quantized
        notes[:] = [n for n in notes if not n.startswith("already rewritten")]
        notes.append(f"already rewritten: {len(plan.existing_sites)} depth_attention sites kept as they are; only "
                     "the weights are quantized")
    elif not new_sites:
        if queries is not None:
            onnx_queries.check(model, queries, queries_from)  # no sites here: refused in one line
        return ExportResult(build(plan, view, config, "onnx", notes=notes + ["no file written"], extra=analysis.fused_ops))
    if verify_outputs:
        _check_test_inputs(model, input_shapes or {})
    external = bool(onnx_io.external_tensors(model))
    onnx_io.load_data(model, path)
    sites = RewriteSites(plan, config, view)
    rewriting = [sites, *([FuseNorms(view)] if fuse_norms else [])] if new_sites else []
    done = passes.run(model, [*rewriting, *(p() for p in FINALIZE)])
    if queries is not None:
        onnx_queries.check(model, queries, queries_from)  # before any run: a mismatch costs nothing
    verification, extra = None, {**analysis.fused_ops, **({} if rewrite_chains else {"rewritten": False})}
    with onnx_io.staged(output) as stage, _float32_scratch(weights) as scratch:
        fp32 = scratch / output.name if scratch else stage.path
        if queries is not None and not verify_outputs:
            onnx_queries.set_queries(model, queries, queries_from)
        onnx_io.write(model, fp32, external, onnx_io.data_name(stage) if not scratch else None)
        check_written(fp32)
        carried.write(stage.folder)  # a genai folder's other files commit with the model, in one step
        if verify_outputs:
            from . import runtime as ort_backend

            tolerance = (verify.tolerance(config.scale, any(c.changes_function for c in plan.to_rewrite))
                         if new_sites else verify.tolerance("preserve", False))
            with progress.stage("verifying in onnxruntime"):
                verification, verified, run_notes = ort_backend.compare_files(
                    path, fp32, tolerance, input_shapes, timeout=verify_timeout,
                    consequence="the rewritten model was not written")
            verify.refuse_failed(verification, config.scale if new_sites else "preserve")
            notes += run_notes
            extra["verified_shapes"] = [{k: list(v) for k, v in shapes.items()} for shapes in verified]
            if queries is not None:  # verified at zero queries (exact: the rewrite itself), then the trained ones
                with progress.stage(f"setting {len(queries)} trained queries"):
                    onnx_queries.set_queries(model, queries, queries_from)
                    onnx_io.write(model, fp32, external, onnx_io.data_name(stage) if not scratch else None)
                    check_written(fp32)
        if weights:
            del model
            extra["weights"] = _quantized(fp32, stage, weights, eval_ids, "--eval-ids", verify_outputs, verify_timeout,
                                          external)
    if queries is not None:
        notes.append(f"{len(queries)} pseudo-queries set from {queries_from}"
                     + (" after the verification, which ran with zero queries (where the rewrite computes the "
                        "original)" if verify_outputs else ""))
    written = list(stage.written)
    notes += [n for n in [carried.note(output)] if n]
    report = build(plan, view, config, "onnx", sites.sites if new_sites else [], verification, notes,
                   passes={**analysis.passes, **done}, extra=extra)
    return ExportResult(report, written)


def check_written(path: Path) -> None:
    """What we write must load as an input would (our own checks and the ONNX checker)."""
    try:
        onnx_io.load(path, with_data=False)
    except AttnResError as exc:
        raise AttnResError(f"internal error: the rewritten model fails its own checks ({exc}); nothing written; "
                           "please report this with the input model") from None


MAX_TEST_INPUT_ELEMENTS = 1 << 26  # per generated verification input: 512 MiB while drawn as float64


def _check_test_inputs(model, overrides: dict[str, tuple[int, ...]]) -> None:
    """Check --input-shape against the model and refuse to verify when a generated input would be
    absurdly large (a static dim of 2**40, say), before anything is allocated (default shape set)."""
    from . import cache_dims as onnx_cache_dims
    from . import dims as onnx_dims

    metadata = {p.key: p.value for p in model.metadata_props}
    implied = {k: v.size for k, v in onnx_cache_dims.head_sizes(model).items()}
    sizes = onnx_dims.Dims(onnx_dims.declared(model), overrides, onnx_dims.examples(metadata), implied)
    for name, dims in sizes.shape_sets()[0][0].items():
        count = math.prod(max(int(d), 1) for d in dims)
        if count > MAX_TEST_INPUT_ELEMENTS:
            raise ModelRunError(f"input {name!r} of shape {list(dims)} has {count} elements, too many to generate "
                                "a verification input; nothing written; verify_outputs=False skips verification")


def export_onnx(model: Any, example_inputs: Any, output: str | os.PathLike, config: AttnResConfig | None = None,
                verify_outputs: bool = True, verify_timeout: float | None = None, dynamic: str | None = None,
                with_past: bool = False, fuse_norms: bool = False, rewrite_chains: bool = True,
                weights: str | None = None, eval_ids=None) -> ExportResult:
    """Rewrite a PyTorch model (fx path) and export it to AttnRes ONNX at `output` in one step.

    `dynamic` picks the dims that stay symbolic (fx/dynamic_dims.py); if the dynamic trace or export
    fails, both fall back to static shapes with a note. `verify_outputs` adds "onnxruntime:<output>"
    rows: the file against the original PyTorch model (a failed preserve-mode row: VerificationError,
    nothing written). `with_past`: an HF causal LM's decoder with
    its KV cache, named as optimum names a decoder-with-past file. `fuse_norms`, `rewrite_chains`
    and `weights` as in `rewrite_onnx` (`eval_ids` defaults to the example's input_ids).
    """
    from ..fx import dynamic_dims
    from . import dims as onnx_dims
    from .export import export_or_static

    config = as_config(config)
    if weights and eval_ids is None:
        eval_ids, source = example_ids(example_inputs), "the example inputs' input_ids"
    else:
        source = "eval_ids"
    _check_weights(weights, eval_ids, verify_outputs, "this model's example inputs")
    if with_past:
        from ..fx.trace import decoder_with_past

        model, example_inputs, spec = decoder_with_past(model, example_inputs, None, dynamic)
        args, kwargs = example_inputs, {}
        result = rewrite(model, example_inputs, config, verify_outputs=verify_outputs, dynamic_shapes=spec,
                         rewrite_chains=rewrite_chains)
        spec = (*spec[:3], *spec[3])  # the rewritten module takes the past as separate arguments
        what = "dynamic batch, sequence and past length"
    else:
        args, kwargs = split_inputs(example_inputs)
        result = rewrite(model, example_inputs, config, verify_outputs=verify_outputs, dynamic=dynamic,
                         rewrite_chains=rewrite_chains)
        dims = dynamic_dims.parse(dynamic)
        spec = dynamic_dims.export_spec(dims, model, args or (), kwargs) if result.report["dynamic_dims"] else None
        what = f"dynamic {dims.text}"
    scale = config.scale if rewrite_chains else "preserve"
    verify.refuse_failed(result.report["verification"], scale)  # before the export: nothing to write
    notes = result.report.data["notes"]
    with onnx_io.staged(output) as stage, _float32_scratch(weights) as scratch:
        fp32 = scratch / Path(output).name if scratch else stage.path
        with progress.stage("exporting to ONNX"):
            module = result.graph_module
            if fuse_norms:
                from ..fx.site_norm import fuse_norms as fuse

                module = fuse(pytree_warning.deepcopy(module)).graph_module
            proto = export_or_static(module, args or (), kwargs, spec, what, notes)
        if with_past:
            from ..fx import decoder
            from . import decoder_names as onnx_decoder_names

            onnx_decoder_names.name(proto, model.geometry.input_names(), model.geometry.output_names())
            entry = proto.metadata_props.add()  # what `generate` stops a row at
            entry.key, entry.value = decoder.GENERATION, json.dumps(decoder.generation_ids(model.wraps))
        onnx_dims.record_examples(proto, [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
        onnx_io.write(proto, fp32, data=onnx_io.data_name(stage) if not scratch else None)
        check_written(fp32)
        if verify_outputs and args is not None:
            tolerance = verify.tolerance(config.scale if rewrite_chains else "preserve",
                                         result.report["summary"]["changes_function"])
            if tolerance is not None and tolerance.rtol == verify.PRESERVE_RTOL and verify.has_trained_sites(model):
                tolerance = verify.Tolerance(verify.TRAINED_RTOL, rounding=True)
                notes.append(f"the model's depth-attention sites are trained (non-zero queries): the file is checked "
                             f"against it at rtol {verify.TRAINED_RTOL:g}, rounding through non-uniform depth weights "
                             "over the layers; the conversion itself was checked exact")
            with progress.stage("verifying in onnxruntime"):
                rows = _verify_export(model, args, kwargs, fp32, tolerance, verify_timeout)
            verify.refuse_failed(rows, scale)  # the staged file is discarded
            result.report.data["verification"] = (result.report.data["verification"] or []) + rows
        if weights:
            del proto
            result.report.data["weights"] = _quantized(fp32, stage, weights, eval_ids, source, verify_outputs,
                                                       verify_timeout, False)
    return ExportResult(result.report, stage.written)


class _Unverified(Exception):
    """The grown file failed its check against the model: nothing is written, the caller exports whole."""


def export_grown(decoder, shallow, prefix: str, output: str | os.PathLike, config: AttnResConfig,
                 queries: dict | None = None, verify_outputs: bool = True, verify_timeout: float | None = None,
                 weights: str | None = None, eval_ids=None) -> ExportResult | str:
    """`export_onnx(..., with_past=True)` of a decoder whose layers are alike, at the cost of three:
    `shallow` (fx/decoder.wrap of a view of the model's first three layers, computing the original
    function) is exported, its graph grown to the depth of `decoder` (the wrapped model itself) by
    onnx/replicate.py, rewritten as rewrite_onnx does, `queries` set, and the file checked against
    `decoder` (a converted model checks its trained queries). Where the graph cannot be grown, its
    sites are not the queries' or the file does not match, nothing is written and the reason is
    returned: the caller then exports the whole model.
    """
    from ..fx import decoder as fx_decoder
    from ..fx import hf_experts
    from . import decoder_names as onnx_decoder_names
    from . import dims as onnx_dims
    from .export import NotGrown, export
    from .replicate import deepen

    wrapper, args, _ = decoder
    small, small_args, small_spec = shallow
    geometry = wrapper.geometry
    tensors = {**dict(wrapper.named_parameters(remove_duplicate=False)),
               **dict(wrapper.named_buffers(remove_duplicate=False))}
    lead = len(fx_decoder.INPUTS)
    try:
        with progress.stage(f"exporting {small.geometry.layers} of {geometry.layers} layers to ONNX"), \
                hf_experts.export_friendly(wrapper):  # the view's layers are the model's: its settings hold
            proto = export(small, small_args, None, small_spec,
                           grow=lambda graph: deepen(graph, prefix, geometry.layers, lead, 1, tensors.__getitem__))
    except NotGrown:
        return "its last exported layer is not the one before it shifted by a layer"
    except TraceError as exc:
        return f"its first layers did not export ({first_line(exc, 160)})"
    onnx_decoder_names.name(proto, geometry.input_names(), geometry.output_names())
    entry = proto.metadata_props.add()  # what `generate` stops a row at
    entry.key, entry.value = fx_decoder.GENERATION, json.dumps(fx_decoder.generation_ids(wrapper.wraps))
    onnx_dims.record_examples(proto, list(args))
    output = Path(output)
    with progress.stage("rewriting the grown graph"):
        analysis = _Analysis(proto, output, config, None)
        plan, view, notes = analysis.plan, analysis.view, analysis.notes
        if not plan.to_rewrite:
            return "the grown graph has no residual chain to rewrite"
        sites = RewriteSites(plan, config, view)
        done = passes.run(proto, [sites, *(p() for p in FINALIZE)])
        if queries is not None:
            try:
                onnx_queries.check(proto, queries, "the converted model")
            except AttnResError as exc:
                return f"the grown graph's sites are not the model's ({first_line(exc, 120)})"
            onnx_queries.set_queries(proto, queries, "the converted model")
    notes.append(f"exported as {small.geometry.layers} layers and grown to {geometry.layers} (the layers are alike); "
                 "checked against the whole model")
    trained = any(bool(q.any()) for q in (queries or {}).values())
    tolerance = verify.tolerance(config.scale, any(c.changes_function for c in plan.to_rewrite))
    if trained and tolerance is not None and tolerance.rtol == verify.PRESERVE_RTOL:
        tolerance = verify.Tolerance(verify.TRAINED_RTOL, rounding=True)
        notes.append(f"the model's depth-attention sites are trained (non-zero queries): the file is checked against "
                     f"it at rtol {verify.TRAINED_RTOL:g}, rounding through non-uniform depth weights over the layers")
    extra = dict(analysis.fused_ops)
    rows = None
    try:
        with onnx_io.staged(output) as stage, _float32_scratch(weights) as scratch:
            fp32 = scratch / output.name if scratch else stage.path
            onnx_io.write(proto, fp32, data=onnx_io.data_name(stage) if not scratch else None)
            del proto
            check_written(fp32)
            if verify_outputs:
                with progress.stage("verifying in onnxruntime"):
                    rows = _verify_export(wrapper, args, {}, fp32, tolerance, verify_timeout, blame=False,
                                          names=geometry.input_names())
                if any(r.get("ok") is False for r in rows):
                    raise _Unverified
            if weights:
                extra["weights"] = _quantized(fp32, stage, weights, eval_ids, "eval_ids",
                                              verify_outputs, verify_timeout, False)
    except _Unverified:
        worst = next(r for r in rows if r.get("ok") is False)
        return f"the grown file differs from the model ({verify.describe(worst)})"
    if queries is not None:  # the model is a converted one: what the file was checked against is not the original
        extra["compared"] = "the converted model vs the exported file"
    report = build(plan, view, config, "onnx", sites.sites, rows, notes, passes={**analysis.passes, **done},
                   extra=extra)
    return ExportResult(report, stage.written)


def _check_weights(weights: str | None, eval_ids, verify_outputs: bool, where: str) -> None:
    """`weights` is int8 or int4; verifying it needs token ids (ConfigError before any work)."""
    from . import weights as onnx_weights

    onnx_weights.check_weights(weights)
    if weights and verify_outputs and eval_ids is None:
        raise ConfigError(f"weights={weights!r} is verified on token ids of real text, and {where} gives none: pass "
                          "eval_ids (--eval-ids FILE.npy), or verify_outputs=False")


def example_ids(example_inputs: Any):
    """The example inputs' token ids (an `input_ids` keyword, or the first integer tensor), as numpy, or None."""
    args, kwargs = split_inputs(example_inputs)
    found = kwargs.get("input_ids")
    if found is None:
        found = next((t for t in pytree.tree_leaves((args or (), kwargs)) if isinstance(t, torch.Tensor)
                      and not t.is_floating_point() and t.dtype != torch.bool), None)
    return None if found is None else found.detach().cpu().numpy().reshape(-1, found.shape[-1])


@contextmanager
def _float32_scratch(weights: str | None):
    """A temporary folder for the float32 file a quantized one is made from and checked against (None
    when the output is the float32 file itself)."""
    if not weights:
        yield None
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="attnres-float32-") as folder:
        yield Path(folder)


def _quantized(fp32: Path, stage, weights: str, eval_ids, source: str, verify_outputs: bool,
               timeout: float | None, external: bool) -> dict:
    """The float32 file at `fp32` quantized into `stage` (onnx/weights.py) and, with `verify_outputs`, verified
    against it on `eval_ids` within the stated bounds (VerificationError, nothing written, when out of them)."""
    from . import weights as onnx_weights

    model = onnx_io.load(fp32, with_data=False)
    onnx_io.load_data(model, fp32)
    with progress.stage(f"quantizing the weights to {weights}"):
        quantized, info = onnx_weights.quantize(model, weights)
    del model
    info["weights"] = weights
    onnx_io.write(quantized, stage.path, external, onnx_io.data_name(stage))
    del quantized
    check_written(stage.path)
    if verify_outputs:
        names = onnx_weights.token_names(onnx_io.load(stage.path, with_data=False))
        if isinstance(names, str):
            raise ConfigError(f"weights={weights!r} is verified as a language model's next tokens and {names}; "
                              "nothing written; verify_outputs=False writes it unverified")
        with progress.stage(f"verifying the {weights} weights in onnxruntime"):
            info["verification"] = onnx_weights.evaluate(fp32, stage.path, eval_ids, weights, names, timeout,
                                                         source=source)
        onnx_weights.judge(info)
    return info


def _verify_export(model: Any, args: tuple, kwargs: dict, output: Path, tolerance: tuple,
                   timeout: float | None, blame: bool = True, names: list[str] | None = None) -> list[dict]:
    """The exported file in onnxruntime (isolated child) against the original PyTorch model, output by
    output, on the example inputs and on their zero-row copy (verify.zero_rows) when there is a verdict;
    with `blame`, a failure is looked into (`_blame_export`). `names`: the file's input names of the
    positional `args`, for the report (else arg0, arg1, ...)."""
    from . import runtime as ort_backend

    original = model.module() if isinstance(model, torch.export.ExportedProgram) else model

    def compared(inputs: tuple[tuple, dict]) -> tuple[list[dict], list, dict]:
        expected = [t for t in pytree.tree_leaves(verify.run(original, inputs)) if isinstance(t, torch.Tensor)]
        tensors = [t.numpy() for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        actual = ort_backend.run_file(output, tensors, timeout=timeout, consequence="the exported model was not written")
        names = [f"onnxruntime:{n}" for n in actual]
        expected = dict(zip(names, (e.numpy() for e in expected)))
        return ort_backend.compare_outputs(expected, dict(zip(names, actual.values())), tolerance), tensors, expected

    rows, tensors, expected = compared((args, kwargs))
    zeroed, inputs = verify.zero_rows((args, kwargs)) if tolerance is not None else (None, [])
    if inputs:
        named = dict(zip((f"arg{i}" for i in range(len(args))), names or []))
        verify.fold_zero_rows(rows, compared(zeroed)[0], [named.get(n, n) for n in inputs])
    if blame and any(r.get("ok") is False for r in rows):
        _blame_export(original, args, kwargs, tensors, expected, rows, tolerance, timeout)
    return rows


def _blame_export(original: Any, args: tuple, kwargs: dict, tensors: list, expected: dict, rows: list[dict],
                  tolerance: tuple, timeout: float | None) -> None:
    """After a failed onnxruntime check, the original model exported the same way (static shapes)
    and checked alike: where it fails too, the exporter or onnxruntime computes this model wrongly,
    not the rewrite, and the failed rows say so (`original_export`: that check's line)."""
    import tempfile

    from . import runtime as ort_backend
    from .export import export

    with tempfile.TemporaryDirectory(prefix="attnres-original-") as folder:
        path = Path(folder) / "original.onnx"
        try:
            with verify.kept(original):  # the exporter may run the model
                onnx_io.write(export(original, *verify.fresh((args, kwargs)), None), path)
            actual = ort_backend.run_file(path, tensors, timeout=timeout, consequence="no verdict on the original")
        except Exception:  # noqa: BLE001 - no verdict on the original: the rows stay as they are
            return
    if len(actual) != len(expected):
        return
    checked = {r["output"]: r for r in ort_backend.compare_outputs(expected, dict(zip(expected, actual.values())), tolerance)}
    for row in rows:
        same = checked.get(row["output"])
        if row.get("ok") is False and same is not None and same.get("ok") is False:
            row["original_export"] = verify.describe(same)
