"""TVM artifacts of a decoder with past (issue 38 item 4): dynamic batch, sequence and past length,
prefill (past 0) and one-token steps, greedy generation identical to onnxruntime's and torch's.

The model is samples/hf_decoders.py's 2-layer width-32 Llama (1 KV head of 16), rewritten to
Block (N=2) with its KV cache (`rewrite --with-past`); each format is written and compiled once. The `.pt2`
artifact's cases run under -m heavy (its TVM build, ~30 s of CI).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import tvm
from onnx import TensorProto, helper
from tvm import relax

import attnres_compile as ac
from attnres_compile.cli import program as cli
from attnres_compile.generation import loop as generate_loop
from attnres_compile.backends.tvm import compile_model, load, pipeline
from attnres_compile.backends.tvm.importers import ImportedModel, from_exported_program, from_onnx
from attnres_compile.backends.tvm.program_prepare import convertible
from attnres_compile.cli.generate import open_model
from attnres_compile.core.errors import ConfigError
from attnres_compile.onnx.pipeline import export_onnx
from forked_cli import run_cli
from samples import hf_decoders

ATOL = 1e-5  # logits and presents are O(1): float32 kernels against onnxruntime / torch
SHAPES = [(1, 1, 0), (3, 1, 0), (1, 4, 0), (3, 5, 0), (1, 1, 9), (3, 1, 6), (2, 3, 4)]  # (batch, seq, past)
KV_HEADS, HEAD_DIM, BLOCK2 = 1, 16, ac.AttnResConfig(variant="block", num_blocks=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tvm_decoder")


@pytest.fixture(scope="module")
def onnx_file(folder):
    model, example = hf_decoders.llama_factory()
    export_onnx(model, example, folder / "decoder.onnx", BLOCK2, verify_outputs=False, with_past=True)
    return folder / "decoder.onnx"


@pytest.fixture(scope="module")
def pt2_file(folder):
    path = folder / "decoder.pt2"
    assert cli.main(["rewrite", "samples.hf_decoders:llama_factory", "--with-past", "--blocks", "2", "--no-verify",
                     "-o", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def onnx_artifact(folder, onnx_file):
    manifest = compile_model(onnx_file, folder / "onnx_art")  # checked against onnxruntime at generated shapes
    assert all(row["verdict"] == "pass" for row in manifest["verification"]["rows"])
    return folder / "onnx_art"


@pytest.fixture(scope="module")
def pt2_artifact(folder, pt2_file):
    manifest = compile_model(pt2_file, folder / "pt2_art")  # checked against torch on the program's example inputs
    assert all(row["verdict"] == "pass" for row in manifest["verification"]["rows"])
    return folder / "pt2_art"


def _step(model, batch: int = 1):
    """generate_cmd's step over MODEL (.onnx: onnxruntime, .pt2: torch, folder: TVM) and its empty past."""
    step, empty, *_ = open_model(SimpleNamespace(model=str(model)), batch)
    return step, empty


def feeds(batch: int, seq: int, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ids and pasts, a full mask, positions past..past+seq-1, by the decoder's names."""
    rng = np.random.default_rng(seed)
    pasts = {f"past_key_values.{i}.{kv}": rng.standard_normal((batch, KV_HEADS, past, HEAD_DIM), dtype=np.float32)
             for i in range(2) for kv in ("key", "value")}
    return {"input_ids": rng.integers(0, hf_decoders.VOCAB, (batch, seq)), "attention_mask": np.ones((batch, past + seq), np.int64),
            "position_ids": np.broadcast_to(np.arange(past, past + seq), (batch, seq)).copy(), **pasts}


def _max_error(expected: dict, actual: dict) -> float:
    assert list(expected) == list(actual) and all(e.shape == a.shape for e, a in zip(expected.values(), actual.values()))
    return max(float(np.abs(e - a).max()) for e, a in zip(expected.values(), actual.values()))


@pytest.mark.parametrize("source", ["onnx", pytest.param("pt2", marks=pytest.mark.heavy)])
def test_artifact_matches_its_source_at_any_batch_sequence_and_past(source, request):
    """One artifact, symbolic batch, sequence and past: prefill (past 0), one-token steps, batch 1 and 3,
    against onnxruntime (.onnx) or torch (.pt2). Before the fixes the ONNX build stopped at "Binding of
    variable rmod ... conflicts" and the .pt2 import at "Concat expects all input tensors to have same
    ndim ... 1 and 4" and then "vr must not be None for symbol s61" (exit 13)."""
    artifact = load(request.getfixturevalue(f"{source}_artifact"))
    reference, _ = _step(request.getfixturevalue(f"{source}_file"))
    assert artifact.input_names == list(feeds(1, 1, 0))  # the .pt2's pasts named as the ONNX route names them
    assert all(isinstance(d, str) for d in artifact.manifest["inputs"][3]["shape"][::2])  # batch, past
    for batch, seq, past in SHAPES:
        inputs = feeds(batch, seq, past)
        got = artifact(inputs)
        assert got["present.1.value"].shape == (batch, KV_HEADS, past + seq, HEAD_DIM)
        assert _max_error(reference(inputs), got) <= ATOL, (batch, seq, past)


@pytest.mark.parametrize("source,batch", [("onnx", 1), ("onnx", 3), pytest.param("pt2", 2, marks=pytest.mark.heavy)])
def test_greedy_generation_over_the_artifact_gives_its_sources_tokens(source, batch, request):
    """generate_loop.greedy (what `attnres-compile generate` runs): a prefill with an empty past, then
    one-token steps feeding the presents back, 20 new tokens, over the artifact and over its source."""
    prompt = np.random.default_rng(batch).integers(0, hf_decoders.VOCAB, (batch, 6))
    step, empty = _step(request.getfixturevalue(f"{source}_artifact"), batch)
    reference, _ = _step(request.getfixturevalue(f"{source}_file"), batch)
    got = generate_loop.greedy(step, prompt, empty, 20)
    assert [len(r) for r in got.new_tokens] == [20] * batch and got.tokens.shape == (batch, 26)
    np.testing.assert_array_equal(got.tokens, generate_loop.greedy(reference, prompt, empty, 20).tokens)
    assert len(np.unique(got.tokens[:, 6:])) > 1  # not one token repeated


@pytest.mark.parametrize("source", ["onnx", "fixed", pytest.param("pt2", marks=pytest.mark.heavy)])
def test_a_left_padded_batch_on_the_artifact_gives_the_original_tokens(source, request):
    """Prompts of 6 and 3 tokens, left-padded with a mask, through `generate` on the artifact: HF
    generate()'s tokens on the original model; the source's end-of-sequence and pad ids (recorded by
    rewrite --with-past) reach the manifest. "fixed": the prompts then padded on the right to 16 by the artifact's
    2 x 16 prefill library."""
    artifact = request.getfixturevalue(f"{source}_artifact")
    assert load(artifact).manifest["attnres.generation"] == {"eos_token_id": [], "pad_token_id": 0}
    run = run_cli(["generate", artifact, "--prompt-ids", "5,17,42,8,11,60", "--prompt-ids", "9,3,71",
                   "--max-new-tokens", "16", "--json"])
    assert run.code == 0, run.stderr
    model, _ = hf_decoders.llama_factory()
    prompt = torch.tensor([[5, 17, 42, 8, 11, 60], [0, 0, 0, 9, 3, 71]])
    expected = model.generate(prompt, attention_mask=(prompt != 0).long(), max_new_tokens=16, do_sample=False)
    assert json.loads(run.stdout)["tokens"] == expected.tolist()


def test_a_decode_step_artifact_fixes_batch_and_sequence_and_keeps_the_past_dynamic(onnx_file, tmp_path):
    """`--static-shape input_ids:2x1` fixes the batch and sequence in every input that names them (the
    positions, the pasts, the mask's `past_sequence_length + sequence_length`) and the past stays
    symbolic. Before: the pasts kept a symbolic batch, TVM's Add folded `[0] + past` into a scalar and
    the Unsqueeze of it failed ("Unsqueeze axis 1 is out of range for rank 1"); the mask's sum could
    not be bound with its sequence fixed ("past_sequence_length + sequence_length is not computed")."""
    manifest = compile_model(onnx_file, tmp_path / "step", static_shapes={"input_ids": (2, 1)})
    assert all(row["verdict"] == "pass" for row in manifest["verification"]["rows"])
    shapes = {i["name"]: i["shape"] for i in manifest["inputs"]}
    assert shapes["position_ids"] == [2, 1] and shapes["past_key_values.1.value"] == [2, KV_HEADS, "past_sequence_length", HEAD_DIM]
    assert shapes["attention_mask"] == [2, "past_sequence_length + 1"]
    reference, empty = _step(onnx_file, 2)
    step, _ = _step(tmp_path / "step", 2)
    for past in (0, 3, 9):
        inputs = feeds(2, 1, past)
        assert _max_error(reference(inputs), step(inputs)) <= ATOL, past
    prompt = np.array([[3], [7]])
    np.testing.assert_array_equal(generate_loop.greedy(step, prompt, empty, 16).tokens,
                                  generate_loop.greedy(reference, prompt, empty, 16).tokens)


def test_reshape_to_minus_one_beside_a_sum_of_dims_keeps_a_simple_dim():
    """SDPA's key transpose, as torch.onnx writes it: `[b, h, past + seq, e]` reshaped to `[-1, past + seq, e]`.
    Relax inferred the -1 as `b * (past + seq) * h * e // (past * e + seq * e)`; solved, it is `b * h`."""
    nodes = [helper.make_node("Concat", ["past", "new"], ["keys"], axis=-2),
             helper.make_node("Shape", ["keys"], ["shape"]),
             helper.make_node("Slice", ["shape", "minus_two", "minus_one"], ["length"]),
             helper.make_node("Slice", ["shape", "minus_one", "end"], ["e"]),
             helper.make_node("Concat", ["minus_one", "length", "e"], ["target"], axis=0),
             helper.make_node("Reshape", ["keys", "target"], ["y"])]
    consts = [helper.make_tensor(name, TensorProto.INT64, [1], [value])
              for name, value in (("minus_two", -2), ("minus_one", -1), ("end", np.iinfo(np.int64).max))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("past", TensorProto.FLOAT, ["b", 2, "p", 16]),
                                          helper.make_tensor_value_info("new", TensorProto.FLOAT, ["b", 2, "s", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    mod = from_onnx(model)
    rows, length, e = mod["main"].ret_ty.shape.values
    assert str(rows) == "T.int64(2) * b", rows
    executable = pipeline.build(ImportedModel(mod, "onnx", ["past", "new"], ["y"]), pipeline.make_target("llvm")).executable
    vm = relax.VirtualMachine(executable, tvm.cpu())
    past, new = np.ones((3, 2, 4, 16), np.float32), np.zeros((3, 2, 1, 16), np.float32)
    y = vm["main"](tvm.runtime.tensor(past), tvm.runtime.tensor(new)).numpy()
    np.testing.assert_array_equal(y, np.concatenate([past, new], axis=2).reshape(6, 5, 16))


def test_a_cat_onto_an_empty_vector_imports():
    """HF's DynamicCache starts a layer as `torch.tensor([])` and concatenates the past onto it, which
    torch allows for any rank; TVM's converter refused the ranks."""
    class Cache(torch.nn.Module):
        def forward(self, past, new):
            return torch.cat([torch.cat([torch.tensor([]), past], dim=-2), new], dim=-2)

    any_ = torch.export.Dim.DYNAMIC
    args = (torch.randn(2, 2, 3, 4), torch.randn(2, 2, 5, 4))
    program = torch.export.export(Cache(), args, dynamic_shapes=({0: any_, 2: any_}, {0: any_, 2: any_}), strict=False)
    mod = from_exported_program(convertible(program))
    (result,) = mod["main"].ret_ty.fields
    assert result.ndim == 4


@pytest.fixture(scope="module")
def fixed_artifact(folder, onnx_file):
    """The ONNX decoder compiled through the CLI with libraries for prompts of 1 x 8 and 2 x 16 tokens and for
    one-token steps of batch 1."""
    run = run_cli(["compile", onnx_file, "-o", folder / "fixed_art", "--prefill", "1x8", "--prefill", "2x16",
                   "--decode", "1"])
    assert run.code == 0, run.stderr
    lines = [line.strip() for line in run.stdout.splitlines() if "-1x8.so:" in line or "-2x16.so:" in line
             or "decode-1.so:" in line]
    assert len(lines) == 3, run.stdout
    assert lines[0].startswith("prefill-1x8.so: prompts of batch 1 and up to 8 tokens, empty past"), lines[0]
    assert "verified against the main library at a 6-token prompt, padded" in lines[0], lines[0]
    assert lines[2].startswith("decode-1.so: one-token steps of batch 1, any past"), lines[2]
    assert "verified against the main library at 1 token after a past of 7" in lines[2], lines[2]
    return folder / "fixed_art"


def test_fixed_shape_libraries_run_the_calls_they_fit_and_match_onnxruntime(fixed_artifact, onnx_file):
    """A prompt with an empty past runs on the shortest prefill library of its batch that holds it (padded on
    the right, cut back), a one-token step of batch 1 on the decode library; a longer prompt, another batch or a
    longer step runs on the main library. Every route gives onnxruntime's logits and presents."""
    artifact = load(fixed_artifact)
    names = {shape: shape.library for shape in artifact.fixed}
    assert sorted(names.values()) == ["decode-1.so", "prefill-1x8.so", "prefill-2x16.so"]
    calls = []
    for shape, vm in list(artifact.fixed.items()):
        artifact.fixed[shape] = _Counted(vm, names[shape], calls)
    reference, _ = _step(onnx_file)
    cases = {(1, 5, 0): "prefill-1x8.so", (1, 8, 0): "prefill-1x8.so", (1, 1, 0): "prefill-1x8.so",
             (2, 3, 0): "prefill-2x16.so", (2, 16, 0): "prefill-2x16.so", (1, 1, 3): "decode-1.so",
             (1, 1, 9): "decode-1.so", (1, 9, 0): None, (3, 4, 0): None, (2, 17, 0): None, (2, 1, 4): None,
             (1, 2, 3): None}
    for (batch, seq, past), library in cases.items():
        calls.clear()
        inputs = feeds(batch, seq, past, seed=seq + past)
        got = artifact(inputs)
        assert calls == ([] if library is None else [library]), (batch, seq, past)
        assert got["logits"].shape == (batch, seq, hf_decoders.VOCAB)
        assert _max_error(reference(inputs), got) <= ATOL, (batch, seq, past)


class _Counted:
    """A VM standing in for a library's: records the library's name at each call of main."""

    def __init__(self, vm, name, calls):
        self.vm, self.name, self.calls = vm, name, calls

    def __getitem__(self, function):
        self.calls.append(self.name)
        return self.vm[function]


def test_greedy_generation_on_the_prefill_and_decode_libraries_gives_onnxruntimes_tokens(fixed_artifact, onnx_file):
    """Batch 1: the prompt on prefill-1x8.so, every step on decode-1.so; 20 tokens as onnxruntime gives them."""
    prompt = np.random.default_rng(7).integers(0, hf_decoders.VOCAB, (1, 6))
    step, empty = _step(fixed_artifact)
    reference, _ = _step(onnx_file)
    got = generate_loop.greedy(step, prompt, empty, 20)
    np.testing.assert_array_equal(got.tokens, generate_loop.greedy(reference, prompt, empty, 20).tokens)


def test_the_library_checks_fail_when_the_padding_is_not_cut_where_it_starts(fixed_artifact, monkeypatch):
    """The check compile runs on each fixed-shape library (against the main library) passes on the artifact's
    libraries, and fails when the prefill's cut keeps the last rows instead of the first, or when the decode
    library is checked against the wrong past (the main library given one past longer)."""
    from attnres_compile.backends.tvm import fixed_shapes
    from attnres_compile.backends.tvm.check import tolerance
    from attnres_compile.backends.tvm.vm_files import load as load_library

    manifest = load(fixed_artifact).manifest
    main = load_library(fixed_artifact / manifest["library"])

    def verify(shape):
        library = load_library(fixed_artifact / shape.library)
        return fixed_shapes.verify(shape, main, library, tvm.cpu(), manifest["inputs"], manifest["outputs"],
                                   tolerance(4))["rows"]
    prefill, decode = fixed_shapes.Prefill(1, 8), fixed_shapes.Decode(1)
    assert all(row["ok"] for row in verify(prefill) + verify(decode))
    cut = fixed_shapes.Prefill.cut
    monkeypatch.setattr(fixed_shapes.Prefill, "cut", lambda self, outputs, n: cut(self, {
        k: np.flip(v, fixed_shapes.SEQUENCE_AXIS.get(k, fixed_shapes.CACHE_AXIS)).copy() for k, v in outputs.items()}, n))
    monkeypatch.setattr(fixed_shapes.Decode, "pad", lambda self, feeds: {
        **feeds, **{k: np.roll(v, 1, axis=fixed_shapes.CACHE_AXIS) for k, v in feeds.items() if k.startswith("past")}})
    assert not any(row["ok"] for row in verify(prefill))
    assert not all(row["ok"] for row in verify(decode))


def test_fixed_shape_bad_input_is_one_line(onnx_file, fixed_artifact, tmp_path):
    """A malformed --prefill or --decode, either on a model that is not a decoder with past, and a manifest whose
    prefill entry names the main library: one line each, nothing written."""
    run = run_cli(["compile", onnx_file, "-o", tmp_path / "a", "--prefill", "1x"])
    assert run.code == 2 and run.lines == ["attnres-compile: error: --prefill '1x' is not BATCHxLENGTH with both at "
                                           "least 1, e.g. 1x128"], run.stderr
    run = run_cli(["compile", onnx_file, "-o", tmp_path / "a", "--decode", "0"])
    assert run.code == 2 and run.lines == ["attnres-compile: error: --decode '0' is not a batch size of at least 1, "
                                           "e.g. 1"], run.stderr
    with pytest.raises(ConfigError, match=r"prefill takes \(batch, length\) pairs of positive ints"):
        compile_model(onnx_file, tmp_path / "c", prefill=[(1, 0)])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])])
    import onnx

    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "relu.onnx")
    run = run_cli(["compile", tmp_path / "relu.onnx", "-o", tmp_path / "b", "--decode", "1"])
    assert run.code == 2 and len(run.lines) == 1 and "--decode apply to a decoder with past" in run.lines[0], run.stderr
    assert not any((tmp_path / name).exists() for name in "abc")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    manifest = json.loads((fixed_artifact / "manifest.json").read_text())
    manifest["prefill"][0]["library"] = manifest["library"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    run = run_cli(["generate", damaged, "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    assert run.code == 14 and len(run.lines) == 1 and "prefill[0].library must be a file name" in run.lines[0], run.stderr
