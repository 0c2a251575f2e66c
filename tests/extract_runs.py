"""How the end-to-end tests start bin/extract.py (alone or under torchrun) and compare what runs wrote."""
import sys
from pathlib import Path

import torch

from offline_extract.engine.distributed import free_port
from offline_extract.store.shards import iter_samples

ROOT = Path(__file__).resolve().parents[1]


def extract_command(out, *args, torchrun: int | None = None) -> list[str]:
    cmd = [sys.executable, str(ROOT / "bin" / "extract.py"), "--out", str(out), "--no-progress", *map(str, args)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
               "--master-port", str(free_port()), *cmd[1:]]
    return cmd


def assert_same_samples(out_a, out_b) -> None:
    """Both directories hold the same samples: metadata and tokens exactly, states up to bf16 rounding.

    Exact equality holds for a sample whose batch was the same in both runs. When batches differ
    (another budget, DP size, or a resume that starts mid-corpus), CPU matmuls sum in another order:
    float32 states differ in their last bits, which moves a bf16 value across a rounding boundary now
    and then, i.e. by one bf16 step (rtol 2^-7). Near zero that one step is finer than float32's
    summation noise, hence the absolute floor, far below the states' scale of about 1.
    """
    a = {info.index: (info, t) for info, t in iter_samples(out_a)}
    b = {info.index: (info, t) for info, t in iter_samples(out_b)}
    assert a.keys() == b.keys()
    for index, (info, t) in a.items():
        info_b, t_b = b[index]
        assert info == info_b
        for name in ("input_ids", "loss_mask"):
            assert torch.equal(t[name], t_b[name]), (index, name)
        for name in ("aux_hidden_states", "hidden_states"):
            assert torch.allclose(t[name].float(), t_b[name].float(), rtol=2**-7, atol=1e-6), (index, name)
