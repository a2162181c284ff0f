"""Writes /tmp/d256/pt2_L/{original,block}.pt2 (Llama L x 256, Block N=8) as bench decode writes them (make_variants, save_files), for byhand.py and counts.py: python make_pt2.py 12."""
import collections, time, sys, os
import torch
from pathlib import Path
from attnres_compile.bench.model.measure import make_model
from attnres_compile.bench.decode.measure import make_variants, save_files
torch.set_num_threads(1)
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 12
folder = Path(f"/tmp/d256/pt2_{layers}"); folder.mkdir(exist_ok=True)
if not (folder / "block.pt2").exists():
    model = make_model("llama", layers, 256, 200).model
    variants, fields, args, spec = make_variants(model, 8)
    for v in variants:
        if v.name != "full":
            save_files(v, args, spec, fields["geometry"], folder, ["eager"])
    torch.save(fields["heads"], folder / "heads.pt")
