"""`attnres-compile generate`: greedy tokens from a decoder-with-past on any of our runtimes.

MODEL is a `.onnx` file, a `.pt2` program, a TVM artifact folder, an onnxruntime-genai folder or
a `package.module:factory`. All but genai folders run the same loop (generation/loop.py), so
their tokens compare directly. The report gives set-up (a warm-up call), prefill time and decode
speed apart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..core.errors import ConfigError, InputError, first_line
from ..utils import progress
from . import args as cli_args


def add_command(subparsers) -> None:
    """Register `generate` on the main parser's subparsers."""
    gen = subparsers.add_parser("generate", help="greedy text generation with a KV cache (decoder-with-past models)")
    gen.add_argument("model", help="a decoder with past: MODEL.onnx (rewrite --with-past), MODEL.pt2, a TVM artifact "
                                   "folder (compile), an onnxruntime-genai folder (genai_config.json), or "
                                   "package.module:factory (rewritten in memory)")
    gen.add_argument("--prompt-ids", required=True, action="append", metavar="IDS",
                     help="a prompt's token ids, comma-separated; repeat it (or separate rows with `;`) for a batch: "
                          "rows of different lengths are left-padded, with an attention mask")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per row (default 32)")
    gen.add_argument("--eos-id", type=int, action="append", metavar="ID",
                     help="stop a row at this token id (repeatable); default: the model's own end-of-sequence ids "
                          "(generation_config, config or genai_config beside the file, or recorded by rewrite)")
    gen.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens for every row regardless")
    gen.add_argument("--json", action="store_true", help="print the tokens and timings as JSON")
    cli_args.add_debug(gen)
    gen.set_defaults(run=generate_command, outputs=cli_args.no_outputs)


MAX_ID = 2**63 - 1  # token ids are int64 on every route (int32 in onnxruntime-genai: backends/genai.py)


def prompt_rows(values: list[str]) -> list[list[int]]:
    """`["1,2,3;4,5", "6"]` -> [[1, 2, 3], [4, 5], [6]]: non-empty rows of ids from 0 that fit int64."""
    text = ";".join(values)
    try:
        rows = [[int(t) for t in row.split(",")] for row in text.split(";")]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text[:80]!r}: expected comma-separated token ids, e.g. 1,2,3") from None
    if min(min(r) for r in rows) < 0:
        raise ConfigError(f"--prompt-ids {text[:80]!r}: token ids are 0 or more")
    big = max(max(r) for r in rows)
    if big > MAX_ID:
        raise ConfigError(f"--prompt-ids: token id {big} does not fit int64 (at most {MAX_ID}); "
                          "give the model's own token ids")
    return rows


def generate_command(args) -> int:
    from ..generation.loop import greedy, left_pad, warm_up

    rows = prompt_rows(args.prompt_ids)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be 1 or more")
    if args.ignore_eos and args.eos_id:
        raise ConfigError("--ignore-eos and --eos-id contradict each other: pass one")
    bad = next((e for e in args.eos_id or [] if not 0 <= e <= MAX_ID), None)
    if bad is not None:
        raise ConfigError(f"--eos-id {bad}: token ids are whole numbers from 0 that fit int64 (at most {MAX_ID})")
    from ..backends import genai

    if genai.is_genai_folder(Path(args.model)):
        if args.eos_id:
            raise ConfigError("--eos-id: og.Generator stops at the eos_token_id of the folder's genai_config.json; "
                              "edit it there, or pass --ignore-eos")
        result, warmup, eos, pad = genai.generate(Path(args.model), rows, args.max_new_tokens, args.ignore_eos)
        return _report(args, rows, "onnxruntime-genai (og.Generator)", result, warmup, eos, pad)
    step, empty_past, runtime, ids = open_model(args, len(rows))
    eos, pad = _stop_ids(args, ids)
    prompt, mask = left_pad(rows, pad)
    try:
        with progress.stage(f"warming up {runtime} (first calls: kernel builds on a cold cache, memory)"):
            warmup = warm_up(step, prompt, empty_past, mask)
        result = greedy(step, prompt, empty_past, args.max_new_tokens, eos, mask, pad)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the runtime's own failure, in one line
        raise InputError(f"{args.model}: {runtime} failed to run a decode step ({first_line(exc)}); is it a decoder "
                         "with past (rewrite --with-past)?") from None
    return _report(args, rows, runtime, result, warmup, eos, pad)


def _report(args, rows: list[list[int]], runtime: str, result, warmup_s: float, eos: list[int], pad: int) -> int:
    """Print the new tokens (one row per line) and the timings, or all of it as JSON."""
    data = {"runtime": runtime, "prompt_tokens": rows, "new_tokens": result.new_tokens,
            "new_token_counts": [len(r) for r in result.new_tokens], "stopped": result.stopped,
            "tokens": result.tokens.tolist(),
            "eos_token_ids": eos, "pad_token_id": pad, "warmup_s": warmup_s, "prefill_s": result.prefill_s,
            "prompt_length": result.prompt_length, "decode_s": result.decode_s, "decode_steps": result.decode_steps,
            "decode_tokens_per_s": result.decode_tokens_per_s}
    if args.json:
        print(json.dumps(data))
        return 0
    for row in result.new_tokens:
        print(",".join(map(str, row)))
    stopped = sum(result.stopped)
    print(f"{runtime}: {result.decode_steps + 1} steps x {len(rows)} rows"
          + (f" ({stopped} stopped at end-of-sequence)" if stopped else "")
          + f"; warm-up {warmup_s:.1f} s, prefill {result.prefill_s * 1e3:.1f} ms ({result.prompt_length} tokens), "
          f"decode {result.decode_tokens_per_s:.1f} tokens/s")
    return 0


def _stop_ids(args, ids: dict | None) -> tuple[list[int], int]:
    """(end-of-sequence ids, pad id): --eos-id, else the model's own (none with --ignore-eos); the
    model's pad id, else its first end-of-sequence id (as HF generate() pads), else 0."""
    ids = ids or {"eos_token_id": [], "pad_token_id": None}
    eos = list(args.eos_id or ids["eos_token_id"])
    pad = ids["pad_token_id"] if ids["pad_token_id"] is not None else (eos or [0])[0]
    return ([] if args.ignore_eos else eos), pad


def _ids_of_file(path: Path, recorded) -> dict | None:
    """The model's end-of-sequence and pad ids: recorded in the file by `rewrite --with-past` (or in
    the artifact by `compile`), else from generation_config.json, genai_config.json or config.json
    beside it (an HF, optimum or onnxruntime-genai folder)."""
    from ..backends.genai import GENAI_CONFIG
    from ..fx.decoder import token_ids

    found = token_ids(recorded)
    folder = path if path.is_dir() else path.parent
    for name in ("generation_config.json", GENAI_CONFIG, "config.json"):
        if found is not None:
            break
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError, RecursionError):
            continue
        found = token_ids(data.get("model") if name == GENAI_CONFIG and isinstance(data, dict) else data)
    return found


def open_model(args, batch: int):
    """(step, empty past, runtime name, eos/pad ids or None) for MODEL: the file's kind decides the runtime."""
    path = Path(args.model)
    if path.is_dir():
        return _tvm(path, batch)
    if path.suffix.lower() == ".onnx":
        from ..backends.genai import GENAI_CONFIG

        if os.path.lexists(path.parent / GENAI_CONFIG):  # GroupQueryAttention's inputs are og.Generator's business
            raise InputError(f"{path} is the decoder of an onnxruntime-genai folder: generate with the folder, "
                             f"`attnres-compile generate {path.parent}` (og.Generator runs it)")
        return _onnxruntime(path, batch)
    if path.suffix.lower() == ".pt2":
        return _pt2(path, batch)
    if ":" in args.model and not path.exists():
        return _factory(args, batch)
    raise InputError(f"{path}: not a .onnx file, a .pt2 program, an artifact or onnxruntime-genai folder, or "
                     "package.module:factory")


def _past_inputs(specs: list[tuple[str, list, np.dtype]], batch: int) -> dict[str, np.ndarray]:
    """Zero-length pasts from (name, shape, dtype) declarations: [batch, heads, 0, head_dim]."""
    past = {}
    for name, shape, dtype in specs:
        if not name.startswith("past_key_values."):
            continue
        if len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])):
            raise InputError(f"input {name} is declared {shape}: a past needs static heads and head size, "
                             "[batch, heads, past, head_dim]")
        past[name] = np.zeros((batch, shape[1], 0, shape[3]), dtype=dtype)
    if not past:
        raise InputError("the model takes no past_key_values.* inputs: write it with `rewrite FACTORY -o X.onnx "
                         "--with-past` (or .pt2)")
    return past


def _onnxruntime(path: Path, batch: int):
    from ..fx.decoder import GENERATION
    from ..onnx import io as onnx_io
    from ..onnx.runtime import session as cpu_session

    proto = onnx_io.load(path, with_data=False)  # our checks (external data inside the folder, ...) before onnxruntime
    recorded = next((p.value for p in proto.metadata_props if p.key == GENERATION), None)
    session = cpu_session(path)
    names = [o.name for o in session.get_outputs()]
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
    specs = [(i.name, i.shape, np.dtype(types.get(i.type, np.float32))) for i in session.get_inputs()]
    wanted = {i.name for i in session.get_inputs()}

    def step(feeds):
        return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})))

    return step, _past_inputs(specs, batch), "onnxruntime", _ids_of_file(path, recorded)


def _tvm(path: Path, batch: int):
    from ..backends.tvm.runtime import load
    from ..fx.decoder import GENERATION

    artifact = load(path)
    specs = [(i["name"], i["shape"] or [], np.dtype(i["dtype"])) for i in artifact.manifest["inputs"]]
    wanted = set(artifact.input_names)

    def step(feeds):
        return artifact({k: v for k, v in feeds.items() if k in wanted})

    return step, _past_inputs(specs, batch), "tvm", _ids_of_file(path, artifact.manifest.get(GENERATION))


def _pt2(path: Path, batch: int):
    import torch

    from .. import pt2
    from ..fx import lean as fx_lean
    from ..fx.decoder import GENERATION, INPUTS, PAST

    loaded = pt2.load(path)
    module = loaded.module()
    user = [s.arg.name for s in loaded.program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    values = {n.name: n.meta.get("val") for n in loaded.program.graph.nodes if n.op == "placeholder"}
    names = [*INPUTS, *(PAST.format(i // 2, ("key", "value")[i % 2]) for i in range(len(user) - len(INPUTS)))]
    specs = [(name, [d if isinstance(d, int) else "d" for d in values[arg].shape], np.dtype(str(values[arg].dtype)[6:]))
             for name, arg in zip(names, user) if isinstance(values.get(arg), torch.Tensor)]

    lean = fx_lean.lean_copy(module)  # as generation.torch_step runs an in-memory rewrite

    def step(feeds):
        args = tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names)
        with torch.no_grad():
            out = fx_lean.call(lean, module, args)
        return {k: v.numpy() for k, v in zip(loaded.outputs, out)}

    return step, _past_inputs(specs, batch), "torch (.pt2)", _ids_of_file(path, loaded.meta.get(GENERATION))


def _factory(args, batch: int):
    import torch

    from ..api import rewrite
    from ..core.config import AttnResConfig
    from ..fx.decoder import generation_ids, probe
    from ..generation.serve import torch_step
    from ..utils.factory import load_factory

    model, example = load_factory(args.model)
    result = rewrite(model, example, AttnResConfig(), verify_outputs=False, with_past=True)
    geometry = probe(model, torch.zeros(1, 2, dtype=torch.long))[0]
    empty = {n: t.numpy() for n, t in zip(geometry.input_names()[3:], geometry.empty_past(batch))}
    return torch_step(result.graph_module, geometry.input_names()), empty, "torch (rewritten in memory)", \
        generation_ids(model)
