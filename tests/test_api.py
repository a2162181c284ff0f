"""API behaviour: inputs accepted, trainability, state_dict, idempotence, scale, and bad input."""

import numpy as np
import pytest
import torch
from torch import nn

import attnres_compile as ac
from attnres_compile.core.errors import (ConfigError, DynamicFeatureAxisError, InputError, NoResidualChainError, TraceError)
from samples import hf_models, models


def test_gpt_state_dict_names_and_training_step():
    model, inputs = models.gpt_factory()
    gm = ac.rewrite(model, inputs).graph_module
    keys = set(gm.state_dict())
    assert set(model.state_dict()) <= keys
    queries = sorted(k for k in keys if k.startswith("attnres."))
    assert queries == sorted(f"attnres.chain0.site{k}" for k in range(1, 9))
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for n, p in gm.named_parameters() if n in queries)
    before = {k: v.detach().clone() for k, v in gm.state_dict().items()}
    opt = torch.optim.Adam(gm.parameters(), lr=1e-2)
    target = torch.randint(0, 96, inputs[0].shape)
    loss = nn.functional.cross_entropy(gm(*inputs).flatten(0, 1), target.flatten())
    loss.backward()
    opt.step()
    after = gm.state_dict()
    assert all(not torch.equal(before[q], after[q]) for q in queries)


def test_train_and_eval_switch_dropout():
    """ExportedProgram.module() refuses train()/eval(); the rewritten module switches its dropout."""
    model, inputs = hf_models.gpt2_factory()
    gm = ac.rewrite(model, inputs).graph_module
    assert not gm.training
    gm.train()
    assert gm.training and not torch.equal(gm(**inputs).logits, gm(**inputs).logits)
    gm.eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(**inputs).logits, model(**inputs).logits, atol=1e-5, rtol=0)


def test_state_dict_round_trip(tmp_path):
    model, inputs = hf_models.llama_factory()
    gm = ac.rewrite(model, inputs, ac.AttnResConfig(variant="block", num_blocks=2)).graph_module
    with torch.no_grad():
        for p in gm.attnres.parameters():
            p.normal_()
    torch.save(gm.state_dict(), tmp_path / "sd.pt")
    fresh = ac.rewrite(model, inputs, ac.AttnResConfig(variant="block", num_blocks=2)).graph_module
    missing, unexpected = fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
    assert not missing and not unexpected
    with torch.no_grad():
        torch.testing.assert_close(fresh(**inputs).logits, gm(**inputs).logits, rtol=0, atol=0)


def test_rewriting_a_rewritten_model_finds_nothing_to_do():
    model, inputs = models.gpt_factory()
    for config in (ac.AttnResConfig(), ac.AttnResConfig(variant="block", block_size=2)):
        first = ac.rewrite(model, inputs, config)
        again = ac.rewrite(first.graph_module, inputs, config)
        assert not again.modified
        assert again.report["summary"]["existing_sites"] == 8
        assert again.report["summary"]["sites_rewritten"] == 0
        assert any("already rewritten" in n for n in again.report["notes"])


def test_exported_program_and_graph_module_inputs():
    model, inputs = models.gpt_factory()
    ep = torch.export.export(model, inputs)
    r1 = ac.rewrite(ep, inputs)
    assert r1.report["source"] == "ExportedProgram"
    r2 = ac.rewrite(ep.module(), inputs)
    assert r2.report["source"] == "GraphModule"
    r2.graph_module.train()
    r2.graph_module.eval()
    with torch.no_grad():
        torch.testing.assert_close(r1.graph_module(*inputs), model(*inputs), atol=1e-5, rtol=0)
        torch.testing.assert_close(r2.graph_module(*inputs), model(*inputs), atol=1e-5, rtol=0)


@torch.fx.wrap
def numpy_tanh(x):
    """Opaque to torch.export (numpy on a fake tensor fails), a leaf call for symbolic_trace."""
    return torch.from_numpy(np.tanh(x.detach().numpy()))


class NumpyBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for fc in self.fc:
            x = self.drop(x) + numpy_tanh(fc(x))
        return x


def test_symbolic_trace_fallback_and_eval_dropout():
    model = NumpyBranches().eval()
    x = torch.randn(4, 8)
    result = ac.rewrite(model, (x,))
    assert result.report["source"] == "symbolic_trace"
    assert any("torch.export failed" in n for n in result.report["notes"])
    assert result.report["summary"]["sites_rewritten"] == 3
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(x), model(x), atol=1e-5, rtol=0)


class Untraceable(nn.Module):
    def forward(self, x):
        for _ in range(int(x.sum().item() > 0) + 1):
            x = x + torch.tanh(x)
        if x.max() > 0:
            return x
        return -x


def test_untraceable_model_gives_one_clear_error():
    with pytest.raises(TraceError) as info:
        ac.rewrite(Untraceable(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "\n" not in msg and "torch.export failed" in msg and "symbolic_trace failed" in msg


def test_no_residual_chain():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(NoResidualChainError, match="no residual chain"):
        ac.rewrite(model, (torch.randn(2, 4),))
    assert ac.inspect(model, (torch.randn(2, 4),))["summary"]["chains"] == 0


class AnyWidth(nn.Module):
    """Residual self-attention (a parameter-free contraction) over rows of any width."""

    def forward(self, x):
        for _ in range(3):
            h = nn.functional.layer_norm(x, x.shape[-1:])[:, None]
            x = x + nn.functional.scaled_dot_product_attention(h, h, h)[:, 0]
        return x


def test_dynamic_feature_axis_is_refused():
    dims = {"x": {0: torch.export.Dim("b"), 1: torch.export.Dim("d", min=2, max=64)}}
    with pytest.raises(DynamicFeatureAxisError, match="dynamic feature axis"):
        ac.rewrite(AnyWidth(), (torch.randn(2, 8),), dynamic_shapes=dims)


def test_dynamic_batch_and_sequence_stay_dynamic():
    model, (tokens,) = models.gpt_factory()
    dims = ({0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", max=64)},)
    gm = ac.rewrite(model, (tokens,), dynamic_shapes=dims).graph_module
    other = torch.randint(0, 96, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(gm(other), model(other), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"variant": "blocky"}, "variant"),
    ({"variant": "block"}, "exactly one of"),
    ({"variant": "block", "num_blocks": 2, "block_size": 2}, "exactly one of"),
    ({"num_blocks": 3}, "only to variant 'block'"),
    ({"variant": "block", "num_blocks": 0}, "positive integer"),
    ({"scale": "unit"}, "scale"),
    ({"eps": 0.0}, "eps"),
    ({"min_chain": 0}, "min_chain"),
    ({"feature_axis": 1.5}, "feature_axis"),
])
def test_bad_config_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ac.AttnResConfig(**kwargs)


def test_bad_inputs():
    with pytest.raises(InputError, match="example_inputs are required"):
        ac.rewrite(models.gpt_factory()[0])
    with pytest.raises(InputError, match="must be an nn.Module"):
        ac.rewrite("model.onnx", ())
    with pytest.raises(ConfigError):
        ac.rewrite(models.gpt_factory()[0], models.gpt_factory()[1], config={"variant": "full"})


def test_two_thousand_link_chain():
    """Analysis is about linear in graph size; a 2,000-link chain is analysed and rewritten
    (timings: benchmarks/bench_rewrite_scale.py)."""
    x = torch.randn(2, 4)
    report = ac.inspect(models.long_chain(2000), (x,))
    assert report["chains"][0]["links"] == 2000
    result = ac.rewrite(models.long_chain(2000), (x,), ac.AttnResConfig(variant="block", num_blocks=8), verify_outputs=False)
    assert result.report["summary"]["sites_rewritten"] == 2000
    small = models.long_chain(40)
    out = ac.rewrite(small, (x,), ac.AttnResConfig(variant="block", num_blocks=8)).graph_module(x)
    torch.testing.assert_close(out, small(x), atol=1e-4, rtol=1e-5)
