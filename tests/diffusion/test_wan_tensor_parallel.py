"""Tensor parallelism of the diffusion transformers on 2 gloo processes: each rank keeps half of
the heads and MLP units, and the outputs and gradients (a split parameter's: its rows or columns
of the whole gradient) equal one process's, for Wan text-to-video, Wan2.1 image-to-video and
Wan2.2 A14B's two experts and Qwen-Image (its per-head norms whole, their gradients summed over
the group as the megatron stack sums them); and training at TP=2 on the megatron stack gives the one-process
losses, saves a checkpoint that exports the one-process weights, and resumes at TP=1."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from conftest import losses, run_cli
from loongforge.core.parallel import free_port
from test_wan_context_parallel import _case

CASES = ("t2v", "i2v", "experts", "qwen_image")  # the context-parallel test's cases, split over TP instead


def _run(model, args, kwargs):
    out = model(*args, **kwargs)
    (out.square().sum() * 0.5).backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    from loongforge.core.parallel.split_data import sum_split_grads

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = {}
    for name in CASES:
        model, args, kwargs = _case(name, tp_group=dist.group.WORLD)
        out, grads = _run(model, args, kwargs)
        sum_split_grads(list(model.parameters()), dist.group.WORLD)
        chunks = {n: (p.partition_dim, p.tp_chunks) for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}
        runs[name] = {"out": out, "grads": grads, "split": chunks}
    torch.save(runs, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _whole(parts: list[torch.Tensor], dim: int, chunks: int) -> torch.Tensor:
    """The whole tensor of the ranks' shares (each of `chunks` parts split over the ranks)."""
    return torch.cat([torch.cat([p.chunk(chunks, dim)[i] for p in parts], dim) for i in range(chunks)], dim)


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    runs = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for name in CASES:
        model, args, kwargs = _case(name)
        want_out, want_grads = _run(model, args, kwargs)
        split = runs[0][name]["split"]
        assert any(k.endswith("qkv.weight") for k in split), name  # the test sees split parameters
        for r in runs:
            torch.testing.assert_close(r[name]["out"], want_out, rtol=1e-5, atol=1e-5, msg=name)
        for n, g in want_grads.items():
            if g is None:  # (Qwen-Image's last text stream feeds nothing)
                assert all(r[name]["grads"][n] is None for r in runs), n
                continue
            if n in split:
                got = _whole([r[name]["grads"][n] for r in runs], *split[n])
            else:
                got = runs[0][name]["grads"][n]
                torch.testing.assert_close(runs[1][name]["grads"][n], got, rtol=0, atol=0, msg=f"{name} {n}: TP ranks differ")
            # fp32 sums in another order: within 1e-5 of the gradient's largest entry
            torch.testing.assert_close(got, g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=lambda m: f"{name} {n}: {m}")


def test_megatron_stack_checks():
    """What the megatron stack does not do for diffusion models is refused by name."""
    from loongforge.core.config import load_config
    from loongforge.core.errors import UserError
    from loongforge.diffusion.config import CONFIG_DIR, WanRunConfig
    from loongforge.diffusion.recipe import validate

    def cfg(**parallel):
        c = load_config(WanRunConfig, CONFIG_DIR / "wan_tiny.yaml")
        c.parallel.stack = "megatron"
        for name, value in parallel.items():
            setattr(c.parallel, name, value)
        return c

    validate(cfg(tensor_model_parallel_size=2))
    validate(cfg(tensor_model_parallel_size=2, context_parallel_size=2))
    for parallel, message in (
        ({"tensor_model_parallel_size": 3}, "tensor_model_parallel_size=3 x parallel.context_parallel_size=1 must divide model"),
        ({"tensor_model_parallel_size": 2, "context_parallel_size": 4}, "tensor_model_parallel_size=2 x parallel.context_parallel_size=4"),
        ({"pipeline_model_parallel_size": 2}, "parallel.pipeline_model_parallel_size=2: diffusion models on the megatron stack"),
        ({"sequence_parallel": True}, "parallel.sequence_parallel=True"),
        ({"data_parallel_mode": "fsdp"}, "parallel.data_parallel_mode=fsdp"),
    ):
        with pytest.raises(UserError, match=message):
            validate(cfg(**parallel))
    c = cfg(tensor_model_parallel_size=4)
    c.model.ffn_dim = 90
    with pytest.raises(UserError, match="tensor_model_parallel_size=4 must divide model.ffn_dim=90"):
        validate(c)


SMALL = ["train.micro_batch_size=2", "train.global_batch_size=4", "train.log_interval=1", "data.demo.count=4", "train.ema_decay=0.9"]


def _exported(run, out):
    from safetensors.torch import load_file

    r = run_cli(["convert", str(run), str(out)], module="loongforge.diffusion.cli")
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(str(out / "diffusion_pytorch_model.safetensors"))


@pytest.mark.slow
def test_training_at_tp2_equals_one_process_and_resumes_at_tp1(tmp_path):
    """Wan on the megatron stack at TP=2 (2 gloo processes) gives the losses and gradient norms of
    one process on the torch stack; its checkpoint (split heads, the fused q/k/v in the whole
    model's layout) resumes at TP=1, and the exported EMA weights equal the one-process run's.
    At TP=2 x CP=2 (4 processes) the losses are the one-process ones too."""
    one, split = tmp_path / "one", tmp_path / "tp2"
    r = run_cli(["train", "wan_tiny", *SMALL, "train.train_iters=5", f"checkpoint.run_dir={one}"], module="loongforge.diffusion.cli")
    assert r.returncode == 0, r.stderr[-3000:]
    megatron = [*SMALL, "parallel.stack=megatron", f"checkpoint.run_dir={split}"]
    r = run_cli(
        ["train", "wan_tiny", *megatron, "train.train_iters=3", "parallel.tensor_model_parallel_size=2"],
        nproc=2,
        module="loongforge.diffusion.cli",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(["train", "wan_tiny", *megatron, "train.train_iters=5"], module="loongforge.diffusion.cli")
    assert r.returncode == 0, r.stderr[-3000:]
    _check_same_run(one, split, [1, 2, 3, 4, 5], tmp_path)
    # the torch stack cannot read the megatron stack's checkpoints: one line, nothing changed
    r = run_cli(["train", "wan_tiny", *SMALL, "train.train_iters=6", f"checkpoint.run_dir={split}"], module="loongforge.diffusion.cli")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "was written with parallel.stack=megatron; resume this run with parallel.stack=megatron" in r.stderr.strip().splitlines()[-1]
    assert (split / "checkpoints" / "latest").read_text() == "step_00000005"
    # TP=2 x CP=2 on 4 processes: each TP rank's heads split again over its CP group
    both = tmp_path / "tp2cp2"
    args = [*SMALL, "parallel.stack=megatron", "parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=2"]
    r = run_cli(
        ["train", "wan_tiny", *args, "train.train_iters=2", f"checkpoint.run_dir={both}"], nproc=4, module="loongforge.diffusion.cli"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = losses(both), losses(one)
    assert sorted(got) == [1, 2]
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


def _check_same_run(one, split, steps: list[int], tmp_path) -> None:
    """Losses and gradient norms within 1e-5 relative; exported weights within fp32 round-off."""
    want, got = losses(one), losses(split)
    assert sorted(got) == sorted(want) == steps
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    norms = [[json.loads(line)["grad_norm"] for line in open(d / "metrics.jsonl") if "grad_norm" in line] for d in (one, split)]
    assert len(norms[0]) == len(steps)
    torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]), rtol=1e-5, atol=0)
    a, b = _exported(one, tmp_path / "one_hf"), _exported(split, tmp_path / "tp2_hf")
    assert a.keys() == b.keys()
    for k in a:  # AdamW steps of gradients equal within fp32 round-off
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5 * a[k].abs().max().item(), msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
def test_qwen_image_training_at_tp2_equals_one_process(tmp_path):
    """Qwen-Image at TP=2 on the megatron stack: the one-process losses and gradient norms (its
    per-head norms' gradients summed over the TP group), and the same exported weights."""
    small = [s for s in SMALL if not s.startswith("train.ema")] + ["train.train_iters=3"]
    one, split = tmp_path / "one", tmp_path / "tp2"
    r = run_cli(["train", "qwen_image_tiny", *small, f"checkpoint.run_dir={one}"], module="loongforge.diffusion.cli")
    assert r.returncode == 0, r.stderr[-3000:]
    tp2 = ["parallel.stack=megatron", "parallel.tensor_model_parallel_size=2", f"checkpoint.run_dir={split}"]
    r = run_cli(["train", "qwen_image_tiny", *small, *tp2], nproc=2, module="loongforge.diffusion.cli")
    assert r.returncode == 0, r.stderr[-3000:]
    _check_same_run(one, split, [1, 2, 3], tmp_path)
