"""The rewritten GraphModule trains under DDP and FSDP2 (gloo, 2 CPU processes) as it does in one process.

It is traced at the global batch and each rank runs half of it: the rewritten module takes any
batch size (a module guarded on the traced batch fails with `Guard failed: ids.size()[0] == 8`).
"""

import pytest
import torch.distributed as dist

from samples import train_distributed

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")


def test_ddp_and_fsdp2_match_single_process():
    ref = train_distributed.reference("full", steps=4, world=2)
    results = train_distributed.run(("ddp", "fsdp"), world=2, variant="full", steps=4)
    for mode in ("ddp", "fsdp"):
        assert results[mode]["losses"] == pytest.approx(ref["losses"], abs=1e-5), mode
        assert results[mode]["queries"].keys() == ref["queries"].keys()
        for name, q in ref["queries"].items():
            assert results[mode]["queries"][name] == pytest.approx(q, abs=1e-5), (mode, name)
    assert any(abs(v) > 1e-3 for q in ref["queries"].values() for v in q)  # the pseudo-queries trained
