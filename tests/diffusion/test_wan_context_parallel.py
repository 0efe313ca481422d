"""Ulysses context parallel on 2 gloo processes: each rank holds half of a packed row's tokens
(odd totals, so rows are padded) and the outputs and the summed gradients equal one process's,
for Wan text-to-video (also with one time per token), Wan2.1 image-to-video (condition channels in the patches, CLIP features on
every rank), Wan2.2 A14B's two experts (each expert's samples split apart; also with one expert
unused) and Qwen-Image (image tokens split, the text stream whole on every rank); and a training
run at CP=2 gives the one-process losses on either stack (text-to-video on the torch stack:
test_wan_train)."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import losses, run_cli
from loongforge.core.parallel import free_port

SHAPES = [(3, 4, 6), (1, 6, 2), (2, 2, 2)]  # 18 + 3 + 2 = 23 patch tokens
CASES = ("t2v", "ti2v", "i2v", "experts", "one_expert", "qwen_image")


def _case(name: str, tp_group=None):
    """(model, forward arguments, keyword arguments) of a case, the same in every process (the
    model split over `tp_group` where given: test_wan_tensor_parallel)."""
    from loongforge.diffusion.models.qwen_image import JointPack, QwenImageConfig, QwenImageDiT
    from loongforge.diffusion.models.wan import WanConfig, WanDiT, WanExperts, patchify

    torch.manual_seed(0)
    if name == "qwen_image":
        model = QwenImageDiT(QwenImageConfig(num_attention_heads=4, attention_head_dim=16), tp_group=tp_group)
        shapes, lens = [(1, 3, 4), (1, 2, 3), (1, 1, 3)], [5, 3, 4]  # 21 image tokens
        img, txt = torch.randn(21, 16), torch.randn(sum(lens), 24)
        return model, (img, txt, torch.tensor([0.1, 0.5, 0.9]), JointPack.of(shapes, lens, "cpu")), {}
    i2v = name == "i2v"
    cfg = WanConfig(
        num_attention_heads=4,
        attention_head_dim=12,
        in_channels=12 if i2v else 4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=40,
        num_layers=2,
        image_dim=8 if i2v else None,
        added_kv_proj_dim=48 if i2v else None,
    )
    model = WanExperts(cfg, 500.0, tp_group=tp_group) if "expert" in name else WanDiT(cfg, tp_group=tp_group)
    patches, pack = patchify([torch.randn(cfg.in_channels, *s) for s in SHAPES], cfg)
    times = torch.tensor([50.0, 100.0, 300.0] if name == "one_expert" else [50.0, 600.0, 900.0])
    if name == "ti2v":  # one time per token (Wan2.2 TI2V), the first frame's at 0
        times = torch.cat([torch.cat([torch.zeros(h * w), t.expand((f - 1) * h * w)]) for (f, h, w), t in zip(pack.grids, times)])
    return model, (patches, pack, times, torch.randn(3, 5, 16)), {"image_context": torch.randn(3, 6, 8)} if i2v else {}


def _rows(name: str, model, args, group) -> torch.Tensor:
    """The rows of the whole output this rank returns."""
    from loongforge.core.parallel.ulysses import local_range
    from loongforge.diffusion.models.wan import cp_rows

    if name == "qwen_image":
        return torch.arange(*local_range(args[0].shape[0], dist.get_rank(group), dist.get_world_size(group)))
    return cp_rows(model, args[1], args[2], group)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = {}
    for name in CASES:
        model, args, kwargs = _case(name)
        out = model(*args, dist.group.WORLD, **kwargs)
        (out.square().sum() * 0.5).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        runs[name] = {"out": out.detach(), "rows": _rows(name, model, args, dist.group.WORLD), "grads": grads}
    torch.save(runs, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    runs = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert [r["t2v"]["out"].shape[0] for r in runs] == [12, 11]  # 23 tokens padded to 24, split in two
    assert [r["experts"]["out"].shape[0] for r in runs] == [9 + 3, 9 + 2]  # low: 18 tokens, high: 3 + 2 padded to 6
    for name in CASES:
        model, args, kwargs = _case(name)
        want = model(*args, None, **kwargs)
        (want.square().sum() * 0.5).backward()
        rows = torch.cat([r[name]["rows"] for r in runs])
        assert sorted(rows.tolist()) == list(range(want.shape[0])), name  # every row once
        got = torch.cat([r[name]["out"] for r in runs])
        assert (got - want.detach()[rows]).abs().max() <= 1e-5 * want.abs().max(), name
        for n, p in model.named_parameters():
            if p.grad is None:  # Qwen-Image's last text-stream MLP: no output depends on it
                assert runs[0][name]["grads"][n] is None and runs[1][name]["grads"][n] is None, (name, n)
                continue
            g = runs[0][name]["grads"][n] + runs[1][name]["grads"][n]
            assert (g - p.grad).abs().max() <= 1e-5 * p.grad.abs().max() + 1e-7, (name, n)


SMALL = ["train.micro_batch_size=2", "train.global_batch_size=4", "train.log_interval=1", "train.train_iters=3", "data.demo.count=4"]
# (image-to-video's context-parallel pieces, its condition channels and padded image features, are
# in the two-rank test above; its task slices targets as text-to-video does)
TRAINED = {
    "experts": ("wan_tiny", "boundary_ratio=0.5"),
    "qwen_image": ("qwen_image_tiny",),
    "megatron": ("wan_tiny", "parallel.stack=megatron"),  # (with TP=2 on 4 processes: test_wan_tensor_parallel.py)
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TRAINED))
def test_training_at_cp2_equals_one_process(case, tmp_path):
    """Both ranks of the CP group draw each sample's time, noise and caption dropout from the
    micro-batch's seed (so pick the same expert), and the losses equal one process's."""
    config, *extra = TRAINED[case]
    runs = {}
    for nproc, cp in ((1, 1), (2, 2)):
        d = runs[cp] = tmp_path / f"cp{cp}"
        args = ["train", config, *SMALL, *extra, f"parallel.context_parallel_size={cp}", f"checkpoint.run_dir={d}"]
        r = run_cli(args, nproc=nproc, module="loongforge.diffusion.cli")
        assert r.returncode == 0, r.stderr[-3000:]
    want, got = losses(runs[1]), losses(runs[2])
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (case, step, got[step], want[step])
