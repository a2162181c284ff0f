"""Trained pseudo-queries (and Delta's gates) set into a rewritten ONNX model's zero initializers,
matched by chain, site index and size; any difference between the site lists is refused."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..core.errors import InputError
from .rewrite import PREFIX


def _sites(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """{"chain<i>.site<k>" / "chain<i>.gate<k>": initializer} of the model's pseudo-queries and gates."""
    found = {}
    for init in model.graph.initializer:
        chain, _, site = init.name[len(PREFIX) + 1:].partition(".")
        if init.name.startswith(PREFIX + ".chain") and site[:4] in ("site", "gate") and site[4:].isdigit():
            found[f"{chain}.{site}"] = init
    return found


def _listing(keys) -> str:
    chains: dict[str, int] = {}
    for key in keys:
        chain = key.split(".")[0]
        chains[chain] = chains.get(chain, 0) + (".site" in key)
    return ", ".join(f"{c}: {n} sites" for c, n in sorted(chains.items())) or "no sites"


def check(model: onnx.ModelProto, queries: dict[str, np.ndarray], where: str) -> None:
    """The rewritten model's sites are the queries' sites, each of the same size (InputError otherwise)."""
    sites = _sites(model)
    if sites.keys() != queries.keys():
        missing = sorted(set(queries) - set(sites)) or sorted(set(sites) - set(queries))
        raise InputError(f"{where}'s queries do not fit this model: the rewrite made {_listing(sites)}, the checkpoint "
                         f"has {_listing(queries)} (first difference: {missing[0]}); rewrite with the checkpoint's "
                         "base model and its AttnRes config")
    for key, init in sites.items():
        size = tuple(init.dims)
        if tuple(np.shape(queries[key])) != size:
            raise InputError(f"{where}'s queries do not fit this model: {key} is {list(np.shape(queries[key]))} in the "
                             f"checkpoint and {list(size)} here (another model's checkpoint?)")


def set_queries(model: onnx.ModelProto, queries: dict[str, np.ndarray], where: str) -> int:
    """Write `queries` into the model's query initializers, in place (float32, as rewrite.py made
    them); the number set."""
    check(model, queries, where)
    for key, init in _sites(model).items():
        init.CopyFrom(numpy_helper.from_array(np.asarray(queries[key], dtype=np.float32), init.name))
    return len(queries)
