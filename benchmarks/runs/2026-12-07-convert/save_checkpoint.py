"""Converts SmolLM2-135M to Block(8), plants queries at 0.02 x randn and saves the folder the export was timed on."""
import time

import torch

import attnres_compile as ac
from samples import smollm2

model, tok = smollm2.load()
t = time.perf_counter()
c = ac.convert(model, ac.AttnResConfig(variant="block", num_blocks=8))
print(f"convert {time.perf_counter()-t:.1f} s", flush=True)
with torch.no_grad():
    for n, p in c.named_parameters():
        if "attnres" in n:
            p.copy_(torch.randn_like(p) * 0.02)
c.save_pretrained("/tmp/smolexp/ckpt"); tok.save_pretrained("/tmp/smolexp/ckpt")
print("saved", flush=True)
