"""`attnres-compile generate`: greedy tokens from a decoder-with-past on any of our runtimes.

MODEL is a `.onnx` file (onnxruntime), a `.pt2` program (torch), a TVM artifact folder, or a
`package.module:factory` (rewritten in memory with its KV cache, Full AttnRes, then torch). Each is driven
by the same loop (generate_loop.py), so the runtimes' tokens can be compared directly; the
report gives prefill and decode time and decode tokens per second.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from .errors import ConfigError, InputError, first_line


def add_command(subparsers) -> None:
    """Register `generate` on the main parser's subparsers."""
    gen = subparsers.add_parser("generate", help="greedy text generation with a KV cache (decoder-with-past models)")
    gen.add_argument("model", help="a decoder with past: MODEL.onnx (rewrite --with-past), MODEL.pt2, a TVM artifact "
                                   "folder (compile), or package.module:factory (rewritten in memory)")
    gen.add_argument("--prompt-ids", required=True, metavar="IDS",
                     help="prompt token ids, comma-separated (one sequence); `;` separates the rows of a batch")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--eos-id", type=int, help="stop a row at this token id")
    gen.add_argument("--json", action="store_true", help="print the tokens and timings as JSON")
    gen.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    gen.set_defaults(handler=generate_command)


def prompt_ids(text: str) -> np.ndarray:
    """`1,2,3;4,5,6` -> int64 [[1, 2, 3], [4, 5, 6]]; rows of equal length, ids >= 0."""
    try:
        rows = [[int(t) for t in row.split(",")] for row in text.split(";")]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: expected comma-separated token ids, e.g. 1,2,3") from None
    if len({len(r) for r in rows}) != 1 or not rows[0] or min(min(r) for r in rows) < 0:
        raise ConfigError(f"--prompt-ids {text!r}: every row needs the same number (>= 1) of non-negative ids")
    return np.array(rows, dtype=np.int64)


def generate_command(args) -> int:
    from .generate_loop import greedy

    prompt = prompt_ids(args.prompt_ids)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be 1 or more")
    step, empty_past, runtime = open_model(args, prompt.shape[0])
    try:
        result = greedy(step, prompt, empty_past, args.max_new_tokens, args.eos_id)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the runtime's own failure, in one line
        raise InputError(f"{args.model}: {runtime} failed to run a decode step ({first_line(exc)}); is it a decoder "
                         "with past (rewrite --with-past)?") from None
    data = {"runtime": runtime, "tokens": result.tokens.tolist(), "new_tokens": result.new_tokens,
            "prefill_s": result.prefill_s, "decode_s": result.decode_s, "decode_tokens_per_s": result.decode_tokens_per_s}
    if args.json:
        print(json.dumps(data))
        return 0
    for row in result.tokens:
        print(",".join(map(str, row[prompt.shape[1]:])))
    print(f"{runtime}: {result.new_tokens} new tokens x {prompt.shape[0]} rows; prefill {result.prefill_s * 1e3:.1f} ms "
          f"({prompt.shape[1]} tokens), decode {result.decode_tokens_per_s:.1f} tokens/s")
    return 0


def open_model(args, batch: int):
    """(step, empty past, runtime name) for MODEL: the file's kind decides the runtime."""
    path = Path(args.model)
    if path.is_dir():
        return _tvm(path, batch)
    if path.suffix.lower() == ".onnx":
        return _onnxruntime(path, batch)
    if path.suffix.lower() == ".pt2":
        return _pt2(path, batch)
    if ":" in args.model and not path.exists():
        return _factory(args, batch)
    raise InputError(f"{path}: not a .onnx file, a .pt2 program, an artifact folder or package.module:factory")


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
    from .backends.onnxruntime import session as cpu_session
    from .passes import onnx_io

    onnx_io.load(path, with_data=False)  # our checks (external data inside the folder, ...) before onnxruntime
    session = cpu_session(path)
    names = [o.name for o in session.get_outputs()]
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
    specs = [(i.name, i.shape, np.dtype(types.get(i.type, np.float32))) for i in session.get_inputs()]
    wanted = {i.name for i in session.get_inputs()}

    def step(feeds):
        return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})))

    return step, _past_inputs(specs, batch), "onnxruntime"


def _tvm(path: Path, batch: int):
    from .backends.tvm.runtime import load

    artifact = load(path)
    specs = [(i["name"], i["shape"] or [], np.dtype(i["dtype"])) for i in artifact.manifest["inputs"]]
    wanted = set(artifact.input_names)

    def step(feeds):
        return artifact({k: v for k, v in feeds.items() if k in wanted})

    return step, _past_inputs(specs, batch), "tvm"


def _pt2(path: Path, batch: int):
    import torch

    from . import pt2
    from .decoder import INPUTS, PAST

    loaded = pt2.load(path)
    module = loaded.program.module()
    user = [s.arg.name for s in loaded.program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    values = {n.name: n.meta.get("val") for n in loaded.program.graph.nodes if n.op == "placeholder"}
    names = [*INPUTS, *(PAST.format(i // 2, ("key", "value")[i % 2]) for i in range(len(user) - len(INPUTS)))]
    specs = [(name, [d if isinstance(d, int) else "d" for d in values[arg].shape], np.dtype(str(values[arg].dtype)[6:]))
             for name, arg in zip(names, user) if isinstance(values.get(arg), torch.Tensor)]

    def step(feeds):
        with torch.no_grad():
            out = module(*(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names))
        return {k: v.numpy() for k, v in zip(loaded.outputs, out)}

    return step, _past_inputs(specs, batch), "torch (.pt2)"


def _factory(args, batch: int):
    from .api import rewrite
    from .cli_args import load_factory
    from .config import AttnResConfig
    from .decoder import probe
    from .generation import torch_step

    import torch

    model, example = load_factory(args.model)
    result = rewrite(model, example, AttnResConfig(), verify_outputs=False, with_past=True)
    geometry = probe(model, torch.zeros(1, 2, dtype=torch.long))[0]
    empty = {n: t.numpy() for n, t in zip(geometry.input_names()[3:], geometry.empty_past(batch))}
    return torch_step(result.graph_module, geometry.input_names()), empty, "torch (rewritten in memory)"
