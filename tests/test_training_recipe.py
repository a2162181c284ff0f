"""The fine-tuning recipe (attnres_compile.training): query groups and their warm-up.

The figures that chose the defaults come from benchmarks/finetune_pretrained.py on SmolLM2
(docs/finetune.md); here the mechanics: the groups partition the parameters, the queries get
their own rate and no decay, and the warm-up holds them at the first step and ramps them after.
"""

import pytest
import torch
from torch.nn import functional as F

from attnres_compile import AttnResConfig, rewrite
from attnres_compile.training import QUERY_LR_SCALE, is_query, param_groups, query_warmup
from samples.models import GPT


def _gm():
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, layers=2, heads=2, max_len=16).eval()
    x = torch.randint(0, 64, (4, 16))
    return rewrite(model, (x,), AttnResConfig(variant="full")).graph_module, x


def test_groups_partition_the_parameters():
    gm, _ = _gm()
    weights, queries = param_groups(gm, lr=1e-3, weight_decay=0.1)
    assert (weights["name"], queries["name"]) == ("weights", "attnres_queries")
    assert queries["lr"] == pytest.approx(1e-3 * QUERY_LR_SCALE) and queries["weight_decay"] == 0.0
    assert weights["lr"] == 1e-3 and weights["weight_decay"] == 0.1
    names = {id(p): n for n, p in gm.named_parameters()}
    assert all(is_query(names[id(p)]) for p in queries["params"])
    assert not any(is_query(names[id(p)]) for p in weights["params"])
    assert len(weights["params"]) + len(queries["params"]) == len(list(gm.parameters()))
    assert param_groups(gm, lr=1e-3, query_lr=5e-4)[1]["lr"] == 5e-4


def test_warmup_holds_the_queries_first_then_ramps_them():
    gm, x = _gm()
    opt = torch.optim.SGD(param_groups(gm, lr=1e-2), lr=1e-2)
    sched = query_warmup(opt, steps=4)
    rates = []
    for _ in range(6):
        rates.append([g["lr"] for g in opt.param_groups])
        before = {n: p.detach().clone() for n, p in gm.named_parameters() if is_query(n)}
        opt.zero_grad()
        F.cross_entropy(gm(x).flatten(0, 1), x.roll(1, 1).flatten()).backward()
        opt.step()
        sched.step()
        moved = any(not torch.equal(p, before[n]) for n, p in gm.named_parameters() if is_query(n))
        assert moved == (len(rates) > 1)  # rate 0 at the first step: the queries stay exactly at zero
    q = 1e-2 * QUERY_LR_SCALE
    assert [r[1] for r in rates] == pytest.approx([0, q / 4, q / 2, 3 * q / 4, q, q])
    assert all(r[0] == 1e-2 for r in rates)


def test_refusals():
    torch.manual_seed(0)
    plain = GPT(vocab=64, dim=32, layers=2, heads=2, max_len=16)
    with pytest.raises(ValueError, match="no AttnRes pseudo-queries"):
        param_groups(plain, lr=1e-3)
    with pytest.raises(ValueError, match="param_groups"):
        query_warmup(torch.optim.SGD(plain.parameters(), lr=1e-3))


@pytest.mark.parametrize("option, value", [("lr", float("nan")), ("lr", -1.0), ("lr", float("inf")), ("lr", "0.1"),
                                           ("lr", None), ("weight_decay", -0.1), ("weight_decay", float("nan")),
                                           ("query_lr", float("nan")), ("query_lr", -1e-3),
                                           ("query_lr_scale", float("nan")), ("query_lr_scale", -1.0)])
def test_param_groups_refuses_rates_that_are_not_rates(option, value):
    """Issue 62 item 8: param_groups(gm, lr=nan) and lr=-1 were accepted."""
    from attnres_compile import AttnResConfig, rewrite
    from attnres_compile.training import param_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2)])

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = model

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    gm = rewrite(Chain(), (torch.randn(2, 4),), AttnResConfig(), verify_outputs=False).graph_module
    options = {"lr": 1e-3, option: value}
    with pytest.raises(ValueError, match=f"{option}="):
        param_groups(gm, **options)
