"""bf16 parameters with fp32 master weights (the GPU default): trains close to fp32, keeps fp32
weights in its checkpoints, and resumes exactly."""

import pytest
import torch
from conftest import FAST, losses, run_cli

pytestmark = pytest.mark.slow
ARGS = [*FAST, "train.lr=1e-3", "train.min_lr=1e-3", "train.lr_warmup_iters=0"]


def test_bf16_params_train_close_to_fp32_and_resume_exactly(hf_llama4, tmp_path):
    def train(run, iters, dtype):
        r = run_cli(
            [
                "train",
                "tiny",
                *ARGS,
                f"train.train_iters={iters}",
                f"train.params_dtype={dtype}",
                f"checkpoint.load={hf_llama4}",
                f"checkpoint.run_dir={tmp_path / run}",
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return losses(tmp_path / run)

    fp32 = train("fp32", 4, "float32")
    bf16 = train("bf16", 4, "bfloat16")
    assert bf16[4] < bf16[1]
    for step in range(1, 5):  # bf16 rounds activations and weights to 8 mantissa bits
        assert abs(bf16[step] - fp32[step]) <= 2e-2 * fp32[step], (step, bf16[step], fp32[step])
    assert any(bf16[s] != fp32[s] for s in range(1, 5))  # it really ran in bf16
    train("cut", 2, "bfloat16")
    cut = train("cut", 4, "bfloat16")
    for step in (3, 4):
        assert cut[step] == bf16[step], (step, cut[step], bf16[step])

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "bf16" / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    dtypes = {k: v.properties.dtype for k, v in md.items() if hasattr(v, "properties")}
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes


@pytest.mark.parametrize("layout", ["parallel.pipeline_model_parallel_size=2", "parallel.tensor_model_parallel_size=2"])
def test_bf16_params_across_layouts(layout, hf_llama4, tmp_path):
    """Pipeline stages pass bf16 activations; TP shards keep their masters' attributes."""

    def train(run, *extra, nproc=1):
        r = run_cli(
            [
                "train",
                "tiny",
                *ARGS,
                "train.train_iters=3",
                "train.params_dtype=bfloat16",
                f"checkpoint.load={hf_llama4}",
                f"checkpoint.run_dir={tmp_path / run}",
                *extra,
            ],
            nproc=nproc,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return losses(tmp_path / run)

    one, two = train("one"), train("two", layout, nproc=2)
    for step in (1, 2, 3):  # bf16 sums in another order: a few bf16 ulps apart at most
        assert abs(one[step] - two[step]) <= 2e-3 * one[step], (layout, step, one[step], two[step])


def test_pure_bf16_trains_resumes_exactly_and_saves_fp32(hf_llama4, tmp_path):
    def train(run, iters):
        r = run_cli(
            [
                "train",
                "tiny",
                *ARGS,
                f"train.train_iters={iters}",
                "train.params_dtype=bfloat16",
                "train.master_weights=false",
                f"checkpoint.load={hf_llama4}",
                f"checkpoint.run_dir={tmp_path / run}",
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return losses(tmp_path / run)

    full = train("full", 4)
    assert full[4] < full[1]
    train("cut", 2)
    cut = train("cut", 4)
    for step in (3, 4):
        assert cut[step] == full[step], (step, cut[step], full[step])
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "full" / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    assert {v.properties.dtype for v in md.values() if hasattr(v, "properties")} == {torch.float32}


def test_master_weights_accumulate_in_fp32():
    from loongforge.core.train.precision import MasterWeights

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)
    master = model.weight
    mw = MasterWeights(model, torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16 and master.dtype == torch.float32
    xs = [torch.randn(4, 64, dtype=torch.bfloat16) for _ in range(8)]
    want = torch.zeros(64, 64)
    for x in xs:
        model(x).float().sum().backward()
        g = torch.ones(4, 64, dtype=torch.bfloat16).T @ x  # this micro-batch's bf16 gradient
        want += g.float()
    assert model.weight.grad is None  # moved into the master
    torch.testing.assert_close(master.grad, want, rtol=0, atol=0)
    with torch.no_grad():
        master.add_(1e-3)  # an optimizer step on the master
    mw.copy_to_model()
    torch.testing.assert_close(model.weight, master.to(torch.bfloat16), rtol=0, atol=0)
    with mw.fp32_view():
        assert model.weight is master
    assert model.weight.dtype == torch.bfloat16
