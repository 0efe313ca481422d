"""LLaVA-OneVision's vision side at TP=2 on 2 gloo processes: each rank of the language model's TP
group encodes a contiguous share of the pack's vision items (an anyres image, the two images of a
multi-image sample, a video: one rank gets the video, the other none) and the shares are
gathered; the loss and the vision tower's gradients (summed over the TP group, as the megatron
stack does for parameters marked as split by data) equal one process within 1e-5."""

import os

import torch
import torch.distributed as dist
from loongforge.core.foundation.llava_onevision import image_token_count, video_token_count
from loongforge.core.parallel import free_port
from vlm_oracle import FAMILIES, save_tiny_llava_onevision

IMG, VID = 90, 91
SIZES = [(30, 100), (50, 60), (40, 40)]  # one image alone (3 anyres tiles), then two of one sample (1 tile each)


def pack(tower) -> dict:
    g = torch.Generator().manual_seed(1)
    text = lambda n: torch.randint(0, 80, (n,), generator=g).tolist()  # noqa: E731
    samples = [
        text(4) + [IMG] * image_token_count(tower, *SIZES[0]) + text(3),
        text(2) + [IMG] * image_token_count(tower, *SIZES[1], True) + text(2) + [IMG] * image_token_count(tower, *SIZES[2], True) + text(1),
        text(3) + [VID] * video_token_count(tower, 2) + text(2),
    ]
    lens = [len(s) for s in samples]
    tokens = torch.tensor(sum(samples, []))[None]
    pos = torch.cat([torch.arange(n) for n in lens])
    return dict(
        tokens=tokens,
        positions=pos.expand(3, -1).contiguous(),
        cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
        labels=torch.randint(0, 80, tokens.shape, generator=g),
        pixel_values=torch.randn(5, 3, 28, 28, generator=g),
        image_sizes=torch.tensor(SIZES),
        batch_num_images=torch.tensor([1, 2]),
        pixel_values_videos=torch.randn(1, 2, 3, 28, 28, generator=g),
    )


def loss_and_grads(hf_dir, tp: int) -> dict:
    from loongforge.core.checkpoint.megatron_io import load_full_state
    from loongforge.core.foundation.hf_io import load_hf_state
    from loongforge.core.foundation.hf_mapping import hf_to_lf
    from loongforge.core.parallel import init_parallel
    from loongforge.core.parallel.split_data import sum_split_grads
    from loongforge.vlm.model import VisionLanguageModel, hf_state_table, read_hf_config

    family, cfg = read_hf_config(hf_dir, FAMILIES)
    model = VisionLanguageModel.build(family, cfg, init_parallel(tp, 1, "gloo", "cpu"))
    state = load_hf_state(hf_dir)
    load_full_state(model, hf_to_lf(hf_state_table(family, cfg.arch, state), state, model.cfg))  # this rank's shards
    loss = model(**pack(model.cfg.tower)).sum()
    loss.backward()
    if tp > 1:
        sum_split_grads([p for p in model.vision.parameters() if p.requires_grad], model.language.tp_group)  # as the stack does
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.vision.named_parameters() if p.grad is not None}}


def _worker(rank: int, port: int, hf_dir: str, out: str) -> None:
    os.environ.update(
        LOONGFORGE_DEVICE="cpu", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    torch.save(loss_and_grads(hf_dir, 2), os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_llava_onevision_vision_split_over_tp_equals_one_process(tmp_path):
    hf_dir = save_tiny_llava_onevision(tmp_path / "hf", IMG, VID)
    want = loss_and_grads(hf_dir, 1)
    assert len(want) > 10  # the tower's layers, the projector and image_newline all get gradients
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(hf_dir), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert set(got) == set(want), r
        for k, w in want.items():
            assert float((got[k] - w).abs().max()) <= 1e-5 * float(w.abs().max()) + 1e-9, (r, k)
