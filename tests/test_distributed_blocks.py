"""Called blocks (distributed/blocks.py), checkpointing of them, and deduplicated offload, in one process.

The rewritten GraphModule is outlined into called blocks by torch.export.unflatten; the result must
be the same function (bitwise, at a batch size other than the traced one), with the same parameter
names, the same gradients, and blocks that per-block FSDP2 and checkpointing can act on.
"""

import pytest
import torch
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.distributed import OffloadHistory, SitePolicy, block_names, called_blocks, checkpoint_blocks
from attnres_compile.core.errors import TraceError
from attnres_compile.ops.depth_attention import is_attnres_op
from samples.hf_models import llama_factory
from samples.models import GPT


def _gpt(variant="block"):
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, layers=4, heads=2, max_len=16).eval()
    x = torch.randint(0, 64, (4, 16))
    config = AttnResConfig(variant=variant, num_blocks=2 if variant == "block" else None)
    return rewrite(model, (x,), config).graph_module, x


def _grads(module, x):
    module.zero_grad(set_to_none=True)
    F.cross_entropy(module(x).flatten(0, 1), x.roll(1, 1).flatten()).backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def test_inserted_nodes_carry_their_site_scope():
    gm, _ = _gpt()
    inserted = [n for n in gm.graph.nodes if "attnres" in n.meta]
    assert inserted
    for node in inserted:
        scopes = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        assert any(p.startswith("blocks.") for p in scopes), (node.name, scopes)


@pytest.mark.parametrize("variant", ["block", "full"])
def test_called_blocks_compute_what_the_graph_module_computes(variant):
    gm, x = _gpt(variant)
    module = called_blocks(gm, (x,))
    assert block_names(module) == [f"blocks.{i}" for i in range(4)]
    assert dict(module.named_parameters()).keys() == dict(gm.named_parameters()).keys()
    other = torch.randint(0, 64, (3, 16))  # traced at batch 4: the batch stays dynamic
    assert torch.equal(module(other), gm(other))
    want, got = _grads(gm, other), _grads(module, other)
    assert all(torch.equal(got[n], g) for n, g in want.items())
    assert any(want[n].abs().max() > 0 for n in want if n.startswith("attnres."))
    # each block owns its parameters (what per-block fully_shard gathers) and calls its sites
    assert {n for n, _ in module.get_submodule("blocks.2").named_parameters()} >= {"attn.qkv.weight", "ln1.weight"}


def test_hf_llama_blocks_are_its_decoder_layers():
    model, inputs = llama_factory(layers=3)
    result = rewrite(model, inputs, AttnResConfig(variant="full"))
    module = called_blocks(result.graph_module, (), inputs)
    assert block_names(module) == [f"model.layers.{i}" for i in range(3)]
    want, got = pytree.tree_leaves(result.graph_module(**inputs)), pytree.tree_leaves(module(**inputs))
    assert len(want) == len(got) and all(torch.equal(w, g) for w, g in zip(want, got))


def test_called_blocks_refuse_inputs_the_model_does_not_take():
    gm, x = _gpt()
    with pytest.raises(TraceError, match="could not outline the rewritten model's blocks"):
        called_blocks(gm, (x.float(),))


@pytest.mark.parametrize("save_sites", [True, False])
def test_checkpointed_blocks_give_equal_gradients_and_count_recomputed_sites(save_sites):
    gm, x = _gpt()
    want = _grads(gm, x)
    module = called_blocks(gm, (x,))
    policy = SitePolicy(save_sites=save_sites)
    assert checkpoint_blocks(module, policy) == [f"blocks.{i}" for i in range(4)]
    got = _grads(module, x)
    assert all(torch.equal(got[n], g) for n, g in want.items())
    sites = sum(is_attnres_op(n.target) for n in gm.graph.nodes)
    assert (policy.saved, policy.recomputed) == ((sites, 0) if save_sites else (0, sites))


def test_offload_copies_each_saved_tensor_once():
    gm, x = _gpt()
    want = _grads(gm, x)
    kept = []

    class Counted(OffloadHistory):
        def _pack(self, tensor):
            kept.append(tensor)  # alive until the end: ids stay unique, so distinct tensors can be counted
            return super()._pack(tensor)

    gm.zero_grad(set_to_none=True)
    offload = Counted()
    with offload:
        loss = F.cross_entropy(gm(x).flatten(0, 1), x.roll(1, 1).flatten())
    loss.backward()
    assert all(torch.equal(p.grad, want[n]) for n, p in gm.named_parameters())
    distinct = {(id(t), t._version) for t in kept if not isinstance(t, torch.nn.Parameter)}
    references = sum(not isinstance(t, torch.nn.Parameter) for t in kept)
    assert offload.copies == len(distinct) < references  # save_on_cpu would copy every reference
    assert offload.saves == len(kept)


# ---------------------------------------------------------------------------------------------
# issue 62 item 8: nonsense arguments get one clear exception naming the argument


def test_called_blocks_refuses_a_module_that_is_not_rewritten(capsys):
    """A module that was not rewritten gave torch's "Checking mutability" lines on stdout and a raw
    pytree ValueError ("leaves has length 19 ..."); a plain nn.Module an AttributeError inside a TraceError."""
    from attnres_compile.core.errors import ConfigError

    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, layers=2, heads=2, max_len=16).eval()
    x = torch.randint(0, 64, (2, 16))
    for gm, what in [(torch.fx.symbolic_trace(model), "no depth-attention site"), (model, "not a torch.fx.GraphModule")]:
        with pytest.raises(ConfigError, match=f"called_blocks: gm .*{what}"):
            called_blocks(gm, (x,))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("options, message", [
    ({"num_stages": 2.0}, "num_stages=2.0 is not a whole number"),
    ({"num_stages": True}, "num_stages=True is not a whole number"),
    ({"num_stages": 10**9}, "num_stages=1000000000, but the model has 4 blocks"),
    ({"cuts": "blocks.2"}, "cuts='blocks.2' is not a list of block names"),
    ({"num_stages": 2, "max_carried": -1}, "max_carried=-1: at least 0"),
    ({"num_stages": 2, "stage_ranks": [0, "a"]}, "stage_ranks"),
])
def test_split_stages_refuses_nonsense_in_one_line(options, message):
    """split_stages(num_stages=2.0) ended in a bare TypeError after the export."""
    from attnres_compile.core.errors import ConfigError
    from attnres_compile.distributed import split_stages

    gm, x = _gpt()
    with pytest.raises(ConfigError, match=message):
        split_stages(gm, (x,), **options)
