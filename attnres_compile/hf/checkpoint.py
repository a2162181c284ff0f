"""Save and load a converted model the Hugging Face way.

`save_pretrained(dir)` is transformers' own plus `config.json`'s `attnres` entry and `auto_map`,
`attnres_graph.<dtype>.json` (the rewritten graph as data, program.py) and a three-line
`modeling_attnres.py`. `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` and
`attnres_compile.load(dir)` build the converted class, load the weights and read the graphs: no
trace, no verification, but the graph is checked against the model it will run on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..core.errors import InputError
from ..utils.file_kind import ATTNRES_SECTION
from . import classes
from . import program as prog
from .runtime import Backbone
from .state import Geometry, Program, State, holder

FORMAT = 1
SECTION = ATTNRES_SECTION
MODELING = "modeling_attnres.py"
AUTO_MAP = {"AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM"}
INSTALL = "pip install attnres-compile"
MODELING_TEXT = f'''"""An AttnRes model converted by attnres-compile: the class lives in the package; this file lets
transformers find it (trust_remote_code=True)."""

try:
    from attnres_compile.hf import remote_class
except ImportError as exc:
    raise ImportError("this checkpoint is an AttnRes model converted by attnres-compile: {INSTALL}") from exc

AttnResForCausalLM = remote_class({{base!r}})
'''


def graph_file(dtype: str) -> str:
    return f"attnres_graph.{dtype}.json"


def section(state: State, base: str) -> dict:
    return {"format": FORMAT, "config": state.config, "sites": state.sites, "geometry": state.geometry.data(),
            "output": state.output, "cache_param": state.cache_param, "layers": state.layers, "base": base,
            "graphs": sorted(state.programs)}


def read_section(config, where: str) -> dict:
    """The `attnres` section of a loaded config, checked: a newer format or a malformed section is
    refused in one line."""

    data = getattr(config, SECTION, None)
    if not isinstance(data, dict):
        raise InputError(f"{where} is a Hugging Face checkpoint, not an AttnRes one (its config.json has no "
                         f"'{SECTION}' section): convert it with attnres_compile.convert")
    version = data.get("format")
    if not isinstance(version, int) or version < 1:
        raise InputError(f"{where}: config.json's '{SECTION}' section has no valid format version")
    if version > FORMAT:
        raise InputError(f"{where} was saved by a newer attnres-compile (format {version}; this one reads up to "
                         f"{FORMAT}): pip install -U attnres-compile")
    try:
        geometry = data["geometry"]
        state = State(config=dict(data["config"]), sites=[list(s) for s in data["sites"]],
                      geometry=Geometry(int(geometry["layers"]), list(geometry["heads"]), list(geometry["head_dims"])),
                      output=str(data["output"]), cache_param=str(data["cache_param"]),
                      layers=data.get("layers"))
        if not all(isinstance(c, str) and isinstance(k, int) and isinstance(d, int) for c, k, d in state.sites):
            raise TypeError("sites")
        graphs = [str(g) for g in data.get("graphs", [])]
        base = str(data["base"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{where}: config.json's '{SECTION}' section is malformed ({exc})") from None
    return {"state": state, "graphs": graphs, "base": base}


def remote_class(base_name: str) -> type:
    """The converted class for transformers' class `base_name` (the modeling file's one line)."""
    import transformers


    base = getattr(transformers, base_name, None)
    if not (isinstance(base, type) and issubclass(base, transformers.PreTrainedModel)):
        raise InputError(f"{base_name} is not a transformers model class")
    return classes.converted_class(base, LM)


def load(path: str | os.PathLike, **kwargs) -> torch.nn.Module:
    """A converted model saved with `save_pretrained`, without trust_remote_code; `kwargs` go to
    `from_pretrained` (dtype, device_map, ...)."""
    from transformers import AutoConfig


    where = str(path)
    if os.path.isdir(where) and not os.path.isfile(os.path.join(where, "config.json")):
        raise InputError(f"{where} is neither a Hugging Face checkpoint nor an AttnRes one (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"{where} is neither a Hugging Face checkpoint nor an AttnRes one ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0][:160]})") from None
    found = read_section(config, where)
    return remote_class(found["base"]).from_pretrained(path, config=config, **kwargs)


class LM:
    """The converted causal LM's class: save_pretrained / from_pretrained of an AttnRes checkpoint."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        found = read_section(config, type(self).__name__)
        attach(self, found["state"], queries=True)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from transformers import AutoConfig

        where = str(pretrained_model_name_or_path)
        config = kwargs.get("config")
        if not hasattr(config, "to_dict"):
            hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in kwargs}
            config = kwargs["config"] = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        found = read_section(config, where)
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        state = model.get_decoder().attnres_state
        for dtype in found["graphs"]:
            data = _read_graph(pretrained_model_name_or_path, dtype, kwargs)
            _check_graph(data, model.get_decoder(), where)
            state.programs[dtype] = Program(data)
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        backbone = self.get_decoder()
        state = backbone.attnres_state
        self.config.attnres = section(state, self._attnres_base.__name__)
        self.config.auto_map = dict(AUTO_MAP)
        # transformers' custom_object_save would copy this package's file into the folder where the class
        # was registered for an auto class (as a trust_remote_code load does): shadowed while saving
        self.__dict__["_auto_class"] = None
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            del self.__dict__["_auto_class"]
        if not kwargs.get("is_main_process", True):
            return
        folder = Path(save_directory)
        for dtype, program in state.programs.items():
            (folder / graph_file(dtype)).write_text(json.dumps(program.data, separators=(",", ":")))
        (folder / MODELING).write_text(MODELING_TEXT.format(base=self._attnres_base.__name__))


def _read_graph(path, dtype: str, kwargs: dict) -> dict:
    from transformers.utils import cached_file


    hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in kwargs}
    name = graph_file(dtype)
    try:
        resolved = cached_file(path, name, **hub)
        with open(resolved, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: the AttnRes graph {name} is missing or unreadable ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != prog.FORMAT or data.get("dtype") != dtype:
        raise InputError(f"{path}: {name} is not an attnres-compile graph of format {prog.FORMAT} for {dtype}")
    return data


def _check_graph(data: dict, backbone, where: str) -> None:
    """Every module and attribute the graph names exists in `backbone` with its recorded class and
    shape, and the graph parses: a site plan or graph for another architecture is refused here."""

    problem = None
    for target, name in (data.get("modules") or {}).items():
        try:
            module = backbone.get_submodule(target)
        except AttributeError:
            problem = f"names the module {target}, which the model lacks"
            break
        if classes.base_class(module).__name__ != name:
            problem = f"calls {target} as a {name}, the model's is a {classes.base_class(module).__name__}"
            break
    for target, shape in (data.get("attrs") or {}).items():
        if problem:
            break
        owner, _, leaf = target.rpartition(".")
        try:
            value = getattr(backbone.get_submodule(owner) if owner else backbone, leaf)
        except AttributeError:
            problem = f"reads {target}, which the model lacks"
            break
        if not isinstance(value, torch.Tensor) or list(value.shape) != list(shape):
            problem = f"reads {target} as {list(shape)}, the model's is {list(getattr(value, 'shape', []))}"
    if problem is None:
        try:
            prog.from_data(data)
        except prog.GraphDataError as exc:
            problem = f"does not parse ({exc})"
    if problem:
        raise InputError(f"{where}: the AttnRes graph for {data.get('dtype')} {problem}: the checkpoint's site plan "
                         f"does not match its base architecture (config.json edited, or files from another model?)")


def attach(lm: nn.Module, state: State, queries: bool) -> None:
    """Make `lm` (unconverted, or half-built by from_pretrained) the converted model of `state`:
    classes swapped, the queries' holder added (zeros), the state in the backbone."""
    backbone = lm.get_decoder()
    classes.swap(lm, LM)
    classes.swap(backbone, Backbone)
    if state.layers:
        for layer in backbone.get_submodule(state.layers):
            classes.swap(layer, classes.Layer)
    if queries:
        backbone.attnres = holder(state.sites, state.config, next(backbone.parameters()).device)
    backbone.__dict__["_attnres_state"] = state
