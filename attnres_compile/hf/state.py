"""What a converted model holds besides its modules: `State` (in the backbone's `__dict__`, shared by
deep copies) holds the AttnRes config, sites, KV geometry, output class, layer location and one
`Program` per parameter dtype; `ModuleState` is the same for a plain nn.Module.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from . import program as prog


@dataclass
class Geometry:
    """What one KV-cache layer holds: [batch, heads[i], length, head_dims[i]] keys and values."""

    layers: int
    heads: list[int]
    head_dims: list[int]

    def empty_past(self, batch: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
        return [torch.zeros(batch, self.heads[i], 0, self.head_dims[i], dtype=dtype, device=device)
                for i in range(self.layers) for _ in range(2)]

    def data(self) -> dict:
        return {"layers": self.layers, "heads": self.heads, "head_dims": self.head_dims}


def holder(sites: list, config: dict, device) -> nn.Module:
    """The trainable AttnRes parameters of `sites` ([chain, site, size] lists), zeros as a rewrite
    makes them: `<chain>.site<k>` pseudo-queries, and for Delta AttnRes `<chain>.gate<k>` gates at
    the config's initial value."""
    gate = (1.0 if config.get("init") == "paper" else 0.0) if config.get("variant") == "delta" else None
    out = nn.Module()
    for chain, site, size in sites:
        if not hasattr(out, chain):
            out.register_module(chain, nn.ParameterDict())
        getattr(out, chain)[f"site{site}"] = nn.Parameter(torch.zeros(size, dtype=torch.float32, device=device))
        if gate is not None:
            getattr(out, chain)[f"gate{site}"] = nn.Parameter(torch.full((1,), gate, dtype=torch.float32,
                                                                         device=device))
    return out


class Program:
    """One dtype's graph as data (program.py) and, per device, its compiled functions."""

    def __init__(self, data: dict):
        self.data = data
        self._compiled: dict[str, prog.Compiled] = {}
        self._lock = threading.Lock()

    def compiled(self, device: torch.device) -> prog.Compiled:
        key = str(device)
        found = self._compiled.get(key)
        if found is None:
            with self._lock:
                graph, blocks = prog.from_data(self.data, device)
                top, layer_graphs = prog.split(graph, blocks, self.data.get("layers"))
                found = prog.Compiled(prog.compile_graph(top, "backbone"),
                                      [prog.compile_graph(g, f"layer {i}") for i, g in enumerate(layer_graphs)])
                self._compiled[key] = found
        return found

    def __reduce__(self):
        return Program, (self.data,)

    def __deepcopy__(self, memo):
        return self


@dataclass
class State:
    config: dict                     # AttnResConfig fields
    sites: list                      # [[chain, site, feature size], ...] in graph order
    geometry: Geometry
    output: str                      # the backbone's output class, a name in transformers.modeling_outputs
    cache_param: str                 # the backbone forward's cache argument: "cache" or "past_key_values"
    layers: str | None               # the decoder layers' ModuleList, relative to the backbone
    programs: dict = field(default_factory=dict)  # dtype name -> Program

    def __deepcopy__(self, memo):
        return self


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parameter_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the backbone computes in: its input embedding's weight's (the first floating
    parameter where it has none)."""
    get = getattr(module, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


@dataclass
class ModuleState:
    """A converted plain nn.Module: its program (one dtype, the one it was converted in), and the
    traced call's input and output structure (torch.export's pytree specs)."""

    config: dict
    sites: list
    program: Program
    in_spec: object
    out_spec: object
    dtype: str

    def __deepcopy__(self, memo):
        return self
