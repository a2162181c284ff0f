"""The rewritten model as called blocks: the nn.Module that FSDP2 and checkpointing work on.

The flat GraphModule never calls a submodule, so FSDP2 and `checkpoint` have nothing to wrap.
The rewrite gives each inserted node its site's `nn_module_stack`, so `torch.export.unflatten`
rebuilds the module tree with the sites inside their blocks and parameters under the same
names; the pseudo-queries (`attnres.*`) stay at the root and are passed to the blocks.
"""

from __future__ import annotations

import contextlib
import inspect
import io
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..core.errors import ConfigError, TraceError
from ..ops.depth_attention import is_attnres_op
from ..utils.pytree_warning import silenced


def called_blocks(gm: fx.GraphModule, example_inputs: Any, kwargs: dict | None = None) -> torch.nn.Module:
    """`gm` (a rewritten GraphModule) as a module whose blocks are called submodules, computing what
    `gm` does (checked bitwise on `example_inputs`) with its parameter names, symbolic dims and mode.
    """
    if not isinstance(gm, fx.GraphModule):
        raise ConfigError(f"called_blocks: gm is a {type(gm).__name__}, not a torch.fx.GraphModule: pass the rewritten "
                          "model (attnres_compile.rewrite(model, inputs).graph_module)")
    if not any(is_attnres_op(n.target) for n in gm.graph.nodes):
        raise ConfigError("called_blocks: gm has no depth-attention site: it is not rewritten (pass "
                          "attnres_compile.rewrite(model, inputs).graph_module)")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(kwargs or {})
    try:  # torch prints "Checking mutability ..." lines on some graphs: stdout is the caller's
        with silenced(), contextlib.redirect_stdout(io.StringIO()):
            ep = torch.export.export(gm, args, kwargs, dynamic_shapes=_dynamic_shapes(gm, args, kwargs), strict=False)
            module = torch.export.unflatten(ep)
    except Exception as exc:  # noqa: BLE001 - the exporter's own reason goes into the one line
        raise TraceError(f"could not outline the rewritten model's blocks: torch.export failed "
                         f"({str(exc).splitlines()[0][:200]}); pass inputs the rewritten model accepts") from exc
    try:
        _check_same(gm, module, args, kwargs)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - a run on the example that fails: the reason in one line
        raise TraceError(f"could not outline the rewritten model's blocks: running them on the example failed "
                         f"({str(exc).splitlines()[0][:200]}); pass inputs the rewritten model accepts") from exc
    return module


def block_names(module: torch.nn.Module) -> list[str]:
    """The blocks of `module` (from `called_blocks`), in call order: the called submodules holding
    depth-attention sites, found by descending from the root while only one called child holds
    them (an HF model's `model`, then its `layers.0` ... `layers.N`). The units to shard with
    `fully_shard` or wrap in `checkpoint`."""
    prefix, holders = "", _holders(module)
    while len(holders) == 1 and _holders(module.get_submodule(prefix + holders[0])):
        prefix += holders[0] + "."
        holders = _holders(module.get_submodule(prefix[:-1]))
    return [prefix + name for name in holders]


def _holders(module: torch.nn.Module) -> list[str]:
    """The call_module targets of `module`'s graph whose module holds a site, in call order."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return []
    targets = dict.fromkeys(n.target for n in graph.nodes if n.op == "call_module")
    return [t for t in targets if _holds_site(module.get_submodule(t))]


def _holds_site(module: torch.nn.Module) -> bool:
    """Whether a graph of `module` or of one of its submodules calls an attnres op."""
    graphs = [g for g in (getattr(m, "graph", None) for m in module.modules()) if isinstance(g, fx.Graph)]
    return any(is_attnres_op(n.target) for g in graphs for n in g.nodes)


def _dynamic_shapes(gm: fx.GraphModule, args: tuple, kwargs: dict) -> dict | None:
    """torch.export `dynamic_shapes` keeping dynamic each input dim that is symbolic in `gm`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bound = inspect.signature(gm.forward).bind(*args, **kwargs).arguments
    leaves, spec = pytree.tree_flatten(bound)
    if len(leaves) != len(placeholders):
        return None
    dims = []
    for leaf, node in zip(leaves, placeholders):
        val = node.meta.get("val")
        if isinstance(leaf, torch.Tensor) and isinstance(val, torch.Tensor):
            dims.append({i: torch.export.Dim.AUTO for i, s in enumerate(val.shape) if isinstance(s, torch.SymInt)} or None)
        else:
            dims.append(None)
    if all(d is None for d in dims):
        return None
    return pytree.tree_unflatten(dims, spec)


def _check_same(gm: fx.GraphModule, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse an outlined module whose names or outputs differ from `gm`'s (a bug, not bad input)."""
    if dict(gm.named_parameters()).keys() != dict(module.named_parameters()).keys():
        missing = sorted(set(dict(gm.named_parameters())) ^ set(dict(module.named_parameters())))
        raise TraceError(f"outlining changed parameter names ({', '.join(missing[:3])}); report this with the model")
    with torch.no_grad():
        want, got = pytree.tree_leaves(gm(*args, **kwargs)), pytree.tree_leaves(module(*args, **kwargs))
    if len(want) != len(got) or any(isinstance(w, torch.Tensor) and not torch.equal(w, g) for w, g in zip(want, got)):
        raise TraceError("the outlined blocks compute something other than the rewritten GraphModule; "
                         "report this with the model")
