"""`ac.convert` on HF causal LMs the suite does not name: traced as three layers and grown
(hf/replicate.py), or traced whole, and the same model either way.

    python benchmarks/convert_unseen.py [NAME ...] [--layers 6] [--out FILE]

Per model (benchmarks/unseen_decoders.py's tiny configs, `--layers` deep): `convert` (Block, N=2)
with replication allowed, then with it turned off; queries planted non-zero in both (a site on the
wrong source shows); the logits of the two compared bit for bit, the converted model's greedy
tokens with the KV cache against the whole trace's, and with zero queries against the original's
`generate()`. One line per model: whether it grew, the two convert times, the checks.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's samples/, run from anywhere
from benchmarks.unseen_decoders import IDS, MODELS, in_fresh_processes  # noqa: E402
from samples.hf_decoders import decoder as tiny_decoder  # noqa: E402


def _convert(model, config, allow: bool):
    from attnres_compile.hf import replicate

    real, grown = replicate.deepen, []

    def spy(*args, **kwargs):
        grown.append(allow and real(*args, **kwargs))
        return grown[-1]

    replicate.deepen = spy
    try:
        import attnres_compile as ac

        start = time.perf_counter()
        converted = ac.convert(model, config)
        return converted, bool(grown and grown[-1]), time.perf_counter() - start
    finally:
        replicate.deepen = real


def check(name: str, layers: int) -> dict:
    import attnres_compile as ac
    from attnres_compile.hf import conversion

    config_cls, model_cls, extra = MODELS[name]
    extra = {k: v for k, v in extra.items() if k != "n_layer"}  # BLOOM's: its config takes num_hidden_layers too
    model, _ = tiny_decoder(config_cls, model_cls, **IDS, **extra, num_hidden_layers=layers)
    row = {"model": name, "layers": len(model.get_decoder().get_submodule(conversion.layers_path(model.get_decoder())))}
    config = ac.AttnResConfig(variant="block", num_blocks=2)
    try:
        fast, row["grown"], row["convert_s"] = _convert(model, config, True)
        ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
        want = model.generate(ids, max_new_tokens=12, do_sample=False)
        row["zero_queries_tokens_equal"] = torch.equal(fast.generate(ids, max_new_tokens=12, do_sample=False), want)
        whole, _, row["whole_convert_s"] = _convert(model, config, False)
        g = torch.Generator().manual_seed(1)
        mine, theirs = dict(fast.named_parameters()), dict(whole.named_parameters())
        with torch.no_grad():
            for key, p in mine.items():
                if "attnres" in key:
                    value = torch.randn(p.shape, generator=g) * 0.5
                    p.copy_(value)
                    theirs[key].copy_(value)
            batch = torch.randint(3, 100, (2, 10), generator=g)
            a = fast(input_ids=batch, use_cache=False).logits
            b = whole(input_ids=batch, use_cache=False).logits
        row["planted_logits_bitwise"] = torch.equal(a, b)
        row["planted_tokens_equal"] = torch.equal(fast.generate(ids, max_new_tokens=12, do_sample=False),
                                                  whole.generate(ids, max_new_tokens=12, do_sample=False))
    except Exception as exc:  # noqa: BLE001 - a model the tool does not take yet is a row, not a crash
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


def main() -> None:
    in_fresh_processes("convert_unseen", __doc__.split("\n")[0])


if __name__ == "__main__":
    main()
