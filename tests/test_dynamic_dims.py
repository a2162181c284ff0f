"""Dynamic input dims: the rewritten module takes any batch and sequence length by default,
`--dynamic` chooses the dims, and a failing dynamic trace or export falls back to static shapes."""

import logging
import re
from pathlib import Path

import onnx
import pytest
import torch

import attnres_compile as ac
from attnres_compile.cli import program as cli
from attnres_compile.core.errors import ConfigError
from attnres_compile.onnx.pipeline import export_onnx
from attnres_compile.fx import dynamic_dims
from attnres_compile.onnx import export as onnx_export
from samples import hf_models, hf_zoo, models



def _dims(path: Path) -> dict[str, list]:
    model = onnx.load(str(path), load_external_data=False)
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
            if i.name not in {t.name for t in model.graph.initializer}}


def test_rewritten_module_takes_any_batch_and_sequence():
    """Traced at batch 2 x 8 tokens, run at 3 x 5 (and 1 x 8): like the original module."""
    model, inputs = hf_models.llama_factory()
    result = ac.rewrite(model, inputs)
    assert result.report["dynamic_dims"] == {"input_ids": [0, 1], "attention_mask": [0, 1]}
    assert not any("stay static" in note for note in result.report["notes"])
    for batch, length in ((3, 5), (1, 8)):
        other = {"input_ids": torch.randint(0, 100, (batch, length)), "attention_mask": torch.ones(batch, length, dtype=torch.long),
                 "use_cache": False}
        with torch.no_grad():
            torch.testing.assert_close(result.graph_module(**other).logits, model(**other).logits, atol=1e-5, rtol=1e-5)
    vit, pixels = hf_models.vit_factory()
    assert ac.inspect(vit, pixels)["dynamic_dims"] == {"pixel_values": [0]}  # image sizes stay static


def test_dynamic_spec_parsing_and_named_dims():
    assert dynamic_dims.parse(None) == dynamic_dims.parse("batch,seq")
    assert dynamic_dims.parse("none").none
    model, (tokens,) = models.gpt_factory()
    spec = dynamic_dims.export_spec(dynamic_dims.parse("idx.1"), model, (tokens,), {})
    assert list(spec[0]) == [1]
    assert ac.inspect(model, (tokens,), dynamic="idx.1")["dynamic_dims"] == {"idx": [1]}
    assert ac.inspect(model, (tokens,), dynamic="none")["dynamic_dims"] == {}
    for bad, match in (("bogus", "neither"), ("none,batch", "cannot be combined"), ("", "empty")):
        with pytest.raises(ConfigError, match=match):
            dynamic_dims.parse(bad)
    with pytest.raises(ConfigError, match="names input 'pixels'"):
        dynamic_dims.export_spec(dynamic_dims.parse("pixels.2"), model, (tokens,), {})
    notes = ac.inspect(model, (tokens[:1],))["notes"]
    assert any("idx[0] stay static" in n for n in notes)


def test_failing_dynamic_trace_and_export_fall_back_to_static(monkeypatch, tmp_path):
    """A model whose dynamic trace or ONNX export fails is traced/exported with static shapes and a one-line note."""
    real = torch.export.export

    def static_only(*args, dynamic_shapes=None, **kwargs):
        if dynamic_shapes is not None:
            raise RuntimeError("Constraints violated (s0)! " + "s0*s1//7 + " * 200)
        return real(*args, **kwargs)

    model, (tokens,) = models.gpt_factory(layers=2)
    monkeypatch.setattr(torch.export, "export", static_only)
    result = export_onnx(model, (tokens,), tmp_path / "gpt.onnx", verify_outputs=False)
    notes = [n for n in result.report["notes"] if "static shapes" in n]
    assert len(notes) == 1 and "traced with static shapes" in notes[0] and len(notes[0]) < 400
    assert result.report["dynamic_dims"] == {} and _dims(tmp_path / "gpt.onnx") == {"idx": [2, 16]}
    monkeypatch.setattr(torch.export, "export", real)
    real_export = onnx_export.export

    def onnx_static_only(module, args, kwargs=None, dynamic_shapes=None):
        if dynamic_shapes is not None:
            raise RuntimeError("\x1b[96mThis is step 2/3\x1b[0m of exporting the model to ONNX. Next steps:")
        return real_export(module, args, kwargs, None)

    monkeypatch.setattr(onnx_export, "export", onnx_static_only)
    notes = []
    proto = onnx_export.export_or_static(model, (tokens,), {}, ({0: torch.export.Dim.AUTO},), "dynamic batch", notes)
    assert notes == ["ONNX export with dynamic batch failed (RuntimeError: This is step 2/3 of exporting the model "
                     "to ONNX. Next steps:); exported with static shapes"]
    assert [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim] == [2, 16]


def test_cli_dynamic_option(tmp_path, capsys):
    """--dynamic none writes static dims; a bad spec or --dynamic on an ONNX file is one line, exit 2."""
    out = tmp_path / "gpt.onnx"
    assert cli.main(["rewrite", "samples.models:gpt_factory", "-o", str(out), "--dynamic", "none", "--no-verify"]) == 0
    assert _dims(out) == {"idx": [2, 16]}
    capsys.readouterr()
    assert cli.main(["inspect", "samples.models:gpt_factory", "--dynamic", "batch,tokens"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--dynamic 'tokens'" in err
    assert cli.main(["inspect", str(out), "--dynamic", "batch"]) == 2
    assert "--dynamic applies to package.module:factory" in capsys.readouterr().err


def test_batch_one_specialization_lines_stay_inside_the_api(capfd, caplog):
    """A batch-1 example under Dim.AUTO made torch.export print one `W... dimension inputs['input_ids']
    .shape[0] 0/1 specialized` line per input to API users; the batch stays static as the report says,
    and the loggers are as they were afterwards."""
    model, inputs = hf_models.gpt2_factory()
    inputs = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    levels = [logging.getLogger(n).level for n in dynamic_dims.EXPORT_LOGGERS]
    with caplog.at_level(logging.WARNING):
        result = ac.rewrite(model, inputs)
    assert result.report["dynamic_dims"] == {"input_ids": [1], "attention_mask": [1]}
    assert not [r for r in caplog.records if "specialized" in r.getMessage()]
    assert "specialized" not in "".join(capfd.readouterr())
    assert [logging.getLogger(n).level for n in dynamic_dims.EXPORT_LOGGERS] == levels


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_chunked_scans_keep_their_links():
    """Mamba2 and Zamba2 pad the sequence to whole chunks and slice it back: the branch's length
    is `(s53 + Mod(4 - Mod(s53, 4), 4))//4 * ...`, which the export's guards prove equal to the
    skip's `s53` (fx_view.InputDims). All links are found (Mamba2 2, Zamba2 3; compared as text:
    0 and 1) and the rewrite is exact."""
    for factory, links in ((hf_zoo.mamba2_factory, [2]), (hf_zoo.zamba2_factory, [1, 2])):
        result = ac.rewrite(*factory())
        report = result.report
        assert [c["links"] for c in report["chains"]] == links, factory.__name__
        assert not any(n.target == "reshape_as" for n in result.graph_module.graph.nodes)  # sources in the site's shape
        assert report["chains"][-1]["status"] == "rewritten" and all(row["ok"] for row in report["verification"])
        assert report["dynamic_dims"] == {"input_ids": [0, 1], "attention_mask": [0, 1]}


def test_note_names_the_dims_the_model_fixes(capsys):
    """FalconMamba's scan loops over the sequence: asked dynamic (the default), the sequence stays
    8, and one note line says which dims, their size and the model's line that fixed them."""
    assert cli.main(["inspect", "samples.hf_zoo:falcon_mamba_factory"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "stay static" in line]
    assert len(notes) == 1, notes
    assert re.fullmatch(r"note: input_ids\[1\], attention_mask\[1\] stay static \(size 8\): torch\.export specialised "
                        r"them at transformers/models/falcon_mamba/modeling_falcon_mamba\.py:\d+ in mamba_selective_scan "
                        r"\(the result takes only these sizes\)", notes[0]), notes[0]
