"""onnxruntime-genai model folders: what a rewrite written to another folder must carry along.

A genai folder (onnxruntime_genai.models.builder) holds the decoder `.onnx` with its external
data, `genai_config.json` (which names the decoder file) and the tokenizer files; `og.Model`
loads the folder. The rewritten file runs in it as it is (its sites are model-local functions of
standard ops), so a rewrite into another folder copies the rest of the folder beside it, with
the config's decoder file name changed to the output's when they differ: the output folder is
then a genai folder whose `og.Generator` gives the original's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import io as onnx_io

CONFIG = "genai_config.json"


def is_genai_folder(folder: Path) -> bool:
    return (folder / CONFIG).is_file()


def sidecars(model_path: Path, output: Path) -> list[tuple[Path, Path]]:
    """(source, destination) for every file of `model_path`'s genai folder the output folder needs:
    the config and the tokenizer and processor files (every regular file but ONNX models and the
    external data files a model of the folder names). Empty when it is no genai folder or the
    output goes into the same folder."""
    folder = model_path.parent
    if not is_genai_folder(folder) or folder.resolve() == output.parent.resolve():
        return []
    data = onnx_io.folder_data_names(folder)
    return [(p, output.parent / p.name) for p in sorted(folder.iterdir())
            if p.is_file() and not p.is_symlink() and p.suffix != ".onnx" and p.name not in data]


def content(source: Path, model_path: Path, output: Path) -> bytes:
    """The bytes to write for `source`: the config with the decoder's file name made the output's."""
    raw = source.read_bytes()
    if source.name != CONFIG or model_path.name == output.name:
        return raw
    config = json.loads(raw)
    decoder = config.get("model", {}).get("decoder", {})
    if decoder.get("filename") == model_path.name:
        decoder["filename"] = output.name
    return json.dumps(config, indent=4).encode()
