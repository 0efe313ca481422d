"""GPU checks of embodied training (run on the lent H200; skipped on CPU): the demo policy trains
on CUDA in bf16 with fp32 master weights, activation recompute changes no loss, bf16 stays near
fp32, and a CUDA-trained run serves on CUDA."""

import os

import numpy as np
import pytest
import torch
from conftest import losses, run_cli

pytestmark = pytest.mark.gpu
MODULE = "loongforge.embodied.cli"
STEPS = 40


def train(run_dir, *args):
    os.environ["LOONGFORGE_DEVICE"] = "cuda"
    try:
        r = run_cli(
            ["train", "pi_tiny", f"train.train_iters={STEPS}", f"checkpoint.run_dir={run_dir}", "train.log_interval=1", *args],
            module=MODULE,
        )
    finally:
        os.environ["LOONGFORGE_DEVICE"] = "cpu"
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(run_dir)


def test_cuda_bf16_recompute_and_fp32_train_alike(tmp_path):
    from loongforge.core.checkpoint.dcp_io import read_model_state

    bf16 = train(tmp_path / "bf16")
    recompute = train(tmp_path / "recompute", "train.recompute=true")
    fp32 = train(tmp_path / "fp32", "train.params_dtype=float32")
    for curve in (bf16, recompute, fp32):
        assert sorted(curve) == list(range(1, STEPS + 1))
        assert np.mean([curve[s] for s in range(STEPS - 4, STEPS + 1)]) < 0.8 * np.mean([curve[s] for s in range(1, 6)]), curve
    # recompute replays the same bf16 kernels: the same losses up to kernel-order rounding
    for s in range(1, STEPS + 1):
        assert abs(recompute[s] - bf16[s]) <= 2e-3 * abs(bf16[s]), (s, recompute[s], bf16[s])
    # bf16 compute over fp32 masters against fp32: close at the start, before the curves drift
    for s in range(1, 4):
        assert abs(bf16[s] - fp32[s]) <= 3e-2 * abs(fp32[s]), (s, bf16[s], fp32[s])
    state = read_model_state(next((tmp_path / "bf16" / "checkpoints").glob("step_*")))
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}  # the masters


def test_cuda_run_serves_and_evaluates_on_cuda(tmp_path):
    from loongforge.embodied.data import LeRobotDataset
    from loongforge.embodied.serving import PolicyRunner

    train(tmp_path / "run", "train.ema_decay=0.9", "lora.rank=4")
    runner = PolicyRunner.from_run_dir(tmp_path / "run", "cuda")
    ds = LeRobotDataset(tmp_path / "run" / "data" / "demo")
    item = ds.get(ds.episode(6).start)
    obs = {c: item[c] for c in runner.inputs.cameras}
    obs.update({"observation.state": np.asarray(item["observation.state"], np.float32), "prompt": item["task"]})
    a, b = runner.infer(obs)["actions"], runner.infer(obs)["actions"]
    assert a.shape == (8, 2) and np.isfinite(a).all() and np.array_equal(a, b)
    r = run_cli(["eval", str(tmp_path / "run"), "--episodes", "6", "--every", "5", "--device", "cuda"], module=MODULE)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("variant", ["pi05", "pi0"])
def test_graphed_sampler_equals_eager_sampling(variant):
    from loongforge.embodied.policies import Observation, PiPolicy
    from test_pi_policy import observation, randomized, tiny

    policy = randomized(PiPolicy(tiny(variant))).cuda()
    sampler = policy.graphed_sampler()

    def on_cuda(obs):
        return Observation(
            *(None if x is None else x.cuda() for x in (obs.images, obs.image_masks, obs.tokens, obs.token_masks, obs.state))
        )

    for b, seed in ((2, 0), (2, 1), (3, 2)):  # new inputs of one shape replay the graph, a new batch captures another
        obs = on_cuda(observation(b=b, seed=seed))
        noise = torch.randn(b, 4, 6, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        got, want = sampler(obs, noise), policy.sample_actions(obs, noise=noise)
        assert got.shape == (b, 4, 6)
        assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), (b, seed)


@pytest.mark.parametrize("variant", ["pi05", "pi0"])
def test_cuda_op_table_policy_equals_reference_ops(variant):
    """The policy as `train` builds it on CUDA (the op table's kernels: Gemma's norm, GeGLU,
    RoPE) against the same weights on core's plain-torch ops, fp32: the loss and every gradient."""
    from loongforge.core.ops import OpTable
    from loongforge.core.registry import registry
    from loongforge.embodied.policies import Observation, PiPolicy
    from test_pi_policy import observation, randomized, tiny

    fast = OpTable.build(None, registry(), "cuda")
    assert fast.gemma_rms_norm is not OpTable().gemma_rms_norm and fast.geglu is not OpTable().geglu
    policies = [randomized(PiPolicy(tiny(variant), ops)).cuda() for ops in (fast, OpTable())]
    policies[1].load_state_dict(policies[0].state_dict())
    obs = observation(b=3, seed=0)
    obs = Observation(*(None if x is None else x.cuda() for x in (obs.images, obs.image_masks, obs.tokens, obs.token_masks, obs.state)))
    g = torch.Generator("cuda")
    actions, noise = torch.randn(3, 4, 6, device="cuda"), torch.randn(3, 4, 6, device="cuda")
    t = torch.tensor([0.1, 0.5, 0.9], device="cuda")
    results = []
    for p in policies:
        loss = p.flow_matching_loss(obs, actions, noise=noise, t=t, generator=g.manual_seed(0)).mean()
        loss.backward()
        results.append((loss.detach(), {n: q.grad for n, q in p.named_parameters() if q.grad is not None}))
    (la, ga), (lb, gb) = results
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys()
    for n in gb:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)
