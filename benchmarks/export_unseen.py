"""`export_onnx(with_past=True)` of trained conversions of HF causal LMs the suite does not name:
exported as three layers and grown (onnx/replicate.py), or whole, and the trained model either way.

    python benchmarks/export_unseen.py [NAME ...] [--layers 6] [--out FILE]

Per model (benchmarks/unseen_decoders.py's tiny configs, `--layers` deep): `convert` (Block, N=2),
queries planted non-zero (0.5 x randn, so a file that drops or misplaces one shows), `ac.export_onnx`
verified in onnxruntime against the converted model, then the file's greedy tokens (KV cache, our
loop) against the converted model's own `generate()`, and against the untrained conversion's (they
must differ, or the check could not fail). One line per model: grown or why not, the export time,
the verification, the tokens.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's samples/, run from anywhere
from benchmarks.unseen_decoders import IDS, MODELS, in_fresh_processes  # noqa: E402
from samples.hf_decoders import decoder as tiny_decoder  # noqa: E402

TOKENS = 12


def check(name: str, layers: int) -> dict:
    import onnxruntime as ort

    import attnres_compile as ac
    from attnres_compile.fx import decoder
    from attnres_compile.generation import loop as generate_loop

    config_cls, model_cls, extra = MODELS[name]
    extra = {k: v for k, v in extra.items() if k != "n_layer"}  # BLOOM's: its config takes num_hidden_layers too
    model, _ = tiny_decoder(config_cls, model_cls, **IDS, **extra, num_hidden_layers=layers)
    row = {"model": name, "layers": layers}
    try:
        converted = ac.convert(model, ac.AttnResConfig(variant="block", num_blocks=2))
        prompt = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
        untrained = converted.generate(prompt, max_new_tokens=TOKENS, do_sample=False)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for key, p in converted.named_parameters():
                if "attnres" in key:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        want = converted.generate(prompt, max_new_tokens=TOKENS, do_sample=False)
        row["planted_changes_tokens"] = not torch.equal(want, untrained)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "m.onnx"
            start = time.perf_counter()
            result = ac.export_onnx(converted, None, path, with_past=True)
            row["export_s"] = round(time.perf_counter() - start, 1)
            notes = result.report.data["notes"]
            row["grown"] = any("grown to" in n for n in notes)
            row["whole_because"] = next((n.split(": ", 1)[1] for n in notes if n.startswith("exported whole")), None)
            row["verified"] = all(r.get("ok") for r in result.report.data["verification"])
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            names = [o.name for o in session.get_outputs()]
            wanted = {i.name for i in session.get_inputs()}
            geometry = decoder.probe(model, prompt)[0]
            empty = {n: t.numpy() for n, t in zip(geometry.input_names()[3:], geometry.empty_past(prompt.shape[0]))}
            got = generate_loop.greedy(lambda f: dict(zip(names, session.run(None, {k: v for k, v in f.items()
                                                                                    if k in wanted}))),
                                       prompt.numpy(), empty, TOKENS).tokens
        row["tokens_equal"] = np.array_equal(np.asarray(got), want.numpy())
    except Exception as exc:  # noqa: BLE001 - a model the tool does not take yet is a row, not a crash
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return row


def main() -> None:
    in_fresh_processes("export_unseen", __doc__.split("\n")[0])


if __name__ == "__main__":
    main()
