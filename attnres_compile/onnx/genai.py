"""onnxruntime-genai model folders: their config read as data, and what a rewrite to another folder carries.

A rewrite into another folder carries the config and tokenizer files beside the rewritten decoder
(the config's decoder file name updated), so the output serves the original's tokens. The config
is read as data only: `read_config` checks it against an allow-list (`SESSION_OPTIONS`,
`SESSION_ENTRIES`, `PROVIDERS`), since onnxruntime options can load libraries or write files, and
refuses anything else (UnsafeConfigError, exit 21; malformed: InputError, exit 6).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import InputError, UnsafeConfigError, first_line
from . import io as onnx_io

CONFIG = "genai_config.json"
MAX_CONFIG_BYTES = 16 << 20  # builder configs are a few KiB
MAX_DEPTH = 32  # builder configs nest 5 deep; og's parser recurses per level

# session options og itself reads; any other key is an onnxruntime session config entry (AddConfigEntry)
SESSION_OPTIONS = {"log_id": str, "intra_op_num_threads": int, "inter_op_num_threads": int,
                   "log_severity_level": int, "log_verbosity_level": int, "enable_cpu_mem_arena": bool,
                   "enable_mem_pattern": bool, "graph_optimization_level": str, "provider_options": list}
# onnxruntime session config entries that only tune computation (the ones the genai builder writes, and spinning)
SESSION_ENTRIES = {"ep.cuda.fpa_intb_gemm", "optimization.disable_specified_optimizers",
                   "session.use_device_allocator_for_initializers", "session.intra_op.allow_spinning",
                   "session.inter_op.allow_spinning", "session.set_denormal_as_zero"}
# execution providers (og's names, lower case) and the options each may set: the builder's, and device choice
PROVIDERS = {"cpu": set(), "cuda": {"enable_cuda_graph", "enable_skip_layer_norm_strict_mode", "device_id",
                                    "prefer_nhwc", "use_tf32"},
             "dml": {"enable_graph_capture", "device_id"}, "webgpu": {"enableGraphCapture", "validationMode"},
             "nvtensorrtrtx": {"enable_cuda_graph", "multi_rotary_cache_concat_offset", "device_id"}}
DEVICE_FILTERING = {"hardware_device_type", "hardware_device_id", "hardware_vendor_id"}
REFUSED = {"custom_ops_library": "loads that shared library into the process (its code runs at once)",
           "enable_profiling": "makes onnxruntime write profiling files wherever the value points"}
_KINDS = {str: "a string", int: "an integer", bool: "a boolean", list: "an array"}
_LIBRARY = re.compile(r"\.(so|dylib|dll)(\.\d+)*$", re.IGNORECASE)
_PATH_KEY = re.compile(r"(^|_)(filename|file|dir|path|folder)$")


def is_genai_folder(folder: Path) -> bool:
    """Whether `folder` holds a genai config (a symlink counts: read_config refuses it in one line)."""
    return os.path.lexists(folder / CONFIG)


def read_config(folder: Path) -> dict:
    """`folder`'s genai_config.json, checked (see the module docstring): InputError for a config that is
    not a regular JSON file of the folder holding `model.decoder`, UnsafeConfigError for one that
    would load code or write files."""
    path = folder / CONFIG
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise InputError(f"{path}: not readable ({exc.strerror or exc})") from None
    if stat.S_ISLNK(mode):
        raise InputError(f"{path} is a symlink: an onnxruntime-genai folder's config must be a regular file in it "
                         f"(copy the file there)")
    if not stat.S_ISREG(mode):
        raise InputError(f"{path} is not a regular file: an onnxruntime-genai folder's config must be one")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise InputError(f"{path}: not readable ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not an onnxruntime-genai config")
    return parse_config(raw, path)


def parse_config(raw: bytes, path: Path | str = CONFIG) -> dict:
    """The checked config from its bytes (read_config without the file checks)."""
    try:
        config = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as exc:
        raise UnsafeConfigError(f"{path}: key {exc.args[0]!r} appears twice in one object (onnxruntime-genai "
                                "applies every copy, a JSON reader only the last): refusing to load it") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise InputError(f"{path}: not readable JSON ({first_line(exc)})") from None
    _check_depth(config, path)
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("decoder"), dict):
        raise InputError(f"{path}: not an onnxruntime-genai config (no \"model\": {{\"decoder\": {{...}}}} object)")
    _check_trust(config, path)
    return config


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _check_depth(config, path) -> None:
    stack = [(config, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InputError(f"{path}: nested more than {MAX_DEPTH} deep: not an onnxruntime-genai config")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((c, depth + 1) for c in children)


def _check_trust(config: dict, path) -> None:
    """UnsafeConfigError for the first thing in `config` that is not known to be data only."""
    stack: list[tuple[str, object]] = [("", config)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                at = f"{where}.{key}" if where else key
                if "\0" in key:
                    _refuse(path, at, item, "is a key with a NUL character")
                if key in REFUSED:
                    _refuse(path, at, item, REFUSED[key])
                if "library" in key.lower():
                    _refuse(path, at, item, "names a library to load")
                if key == "session_options":
                    _session_options(item, at, path)
                elif key == "run_options":
                    _run_options(item, at, path)
                elif _PATH_KEY.search(key) and isinstance(item, str):
                    _file_name(item, at, path)
                stack.append((at, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and (_LIBRARY.search(value.split("\0")[0]) or "\0" in value):
            _refuse(path, where, value, "names a shared library (or holds a NUL character)")


def _refuse(path, at: str, value, why: str) -> None:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise UnsafeConfigError(f"{path}: {at} = {shown} {why}; onnxruntime-genai configs are read as data: refusing "
                            "to load it")


def _session_options(options, at: str, path) -> None:
    if not isinstance(options, dict):
        raise InputError(f"{path}: {at} is not an object")
    for key, value in options.items():
        here = f"{at}.{key}"
        if key in REFUSED:
            _refuse(path, here, value, REFUSED[key])
        if key in SESSION_OPTIONS:
            wanted = SESSION_OPTIONS[key]
            if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
                raise InputError(f"{path}: {here} is not {_KINDS[wanted]}")
            if key == "provider_options":
                _providers(value, here, path)
        elif key not in SESSION_ENTRIES:
            _refuse(path, here, value, "is an onnxruntime session option attnres-compile does not know to be data only "
                    "(some load code or write files, e.g. ep.context_file_path)")
        elif not isinstance(value, str):
            raise InputError(f"{path}: {here} is not a string")


def _providers(providers: list, at: str, path) -> None:
    for i, entry in enumerate(providers):
        if not isinstance(entry, dict):
            raise InputError(f"{path}: {at}[{i}] is not an object")
        for name, options in entry.items():
            here = f"{at}[{i}].{name}"
            known = PROVIDERS.get(_provider(name))
            if known is None:
                _refuse(path, here, options, f"is an execution provider whose options can load libraries or write "
                        f"files; accepted: {', '.join(sorted(PROVIDERS))}")
            if not isinstance(options, dict):
                raise InputError(f"{path}: {here} is not an object")
            for key, value in options.items():
                if key == "device_filtering_options" and isinstance(value, dict) and set(value) <= DEVICE_FILTERING:
                    continue
                if key not in known:
                    _refuse(path, f"{here}.{key}", value, "is a provider option attnres-compile does not know to be "
                            "data only (some name libraries or folders to write)")


def _provider(name: str) -> str:
    """og's provider name normalisation: case-insensitive, without the `ExecutionProvider` suffix."""
    lower = name.lower()
    suffix = "executionprovider"
    return lower[:-len(suffix)] if lower.endswith(suffix) and len(lower) > len(suffix) else lower


def _run_options(options, at: str, path) -> None:
    if not isinstance(options, dict):
        raise InputError(f"{path}: {at} is not an object")
    for key, value in options.items():
        _refuse(path, f"{at}.{key}", value, "is an onnxruntime run option attnres-compile does not know to be data "
                "only (enable_profiling writes files)")


def _file_name(name: str, at: str, path) -> None:
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in parts:
        _refuse(path, at, name, "names a file outside the folder")


# ---------------------------------------------------------------------------------------------
# carrying a genai folder to another folder


@dataclass
class Carried:
    """What a rewrite of a genai folder's model into another folder writes beside it: the config's new
    bytes (checked and with the decoder's file name made the output's), the other files to copy
    (tokenizer, processor), and the files left out (symlinks, never followed)."""

    config: tuple[Path, bytes] | None = None
    copies: list[tuple[Path, Path]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # files the config names that the output folder lacks
    decoder: str | None = None  # the config's decoder file, where it is not the rewritten one

    @property
    def destinations(self) -> list[Path]:
        return ([self.config[0]] if self.config else []) + [dst for _, dst in self.copies]

    def write(self, folder: Path) -> None:
        """Write every carried file into the staging `folder` (committed with the model, in one step)."""
        import shutil

        if self.config:
            (folder / self.config[0].name).write_bytes(self.config[1])
        for src, dst in self.copies:
            shutil.copyfile(src, folder / dst.name, follow_symlinks=False)

    def note(self, output: Path) -> str | None:
        """What the output folder is now: a genai folder og.Model loads, or what it still lacks."""
        if not self.config:
            return None
        names = ", ".join(p.name for p in self.destinations)
        left = f" (not copied: {', '.join(self.skipped)}, symlinks)" if self.skipped else ""
        if self.decoder is not None:
            return (f"copied {names} beside it{left}; its config's decoder is {self.decoder}, not {output.name}: "
                    f"og.Model in {output.parent} would not run the rewritten model")
        if self.missing:
            return (f"copied {names} beside it{left}; {output.parent} lacks {', '.join(self.missing)}, which its "
                    "config names (the folder's other models are not copied): og.Model needs them there")
        return f"copied {names} beside it{left}: {output.parent} is an onnxruntime-genai folder (og.Model loads it)"


def carried(model_path: Path, output: Path) -> Carried:
    """What `output` needs from `model_path`'s genai folder (nothing when it is no genai folder or the
    output goes into the same folder): the config, checked now (read_config), and every other regular
    file but ONNX models and the external data files a model of the folder names."""
    folder = model_path.parent
    if not is_genai_folder(folder) or folder.resolve() == output.parent.resolve():
        return Carried()
    config = read_config(folder)
    decoder = config["model"]["decoder"]
    if model_path.name != output.name and decoder.get("filename") == model_path.name:
        decoder["filename"] = output.name
    result = Carried((output.parent / CONFIG, json.dumps(config, indent=4).encode()))
    data = onnx_io.folder_data_names(folder)
    for p in sorted(folder.iterdir()):
        if p.name == CONFIG or p.suffix == ".onnx" or p.name in data:
            continue
        if p.is_symlink():
            result.skipped.append(p.name)
        elif p.is_file():
            result.copies.append((p, output.parent / p.name))
    if decoder.get("filename") != output.name:
        result.decoder = str(decoder.get("filename"))
    there = {output.name, CONFIG, *(dst.name for _, dst in result.copies)}
    result.missing = sorted({name for name in _file_names(config) if name not in there
                             and not os.path.lexists(output.parent / name)})
    return result


def _file_names(config) -> list[str]:
    """Every `filename` the config names (the decoder, the encoder, vision and pipeline models...)."""
    found, stack = [], [config]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            found += [v for k, v in value.items() if k == "filename" and isinstance(v, str)]
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found
