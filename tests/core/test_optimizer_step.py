"""The trainer's optimizer step: TableAdamW (the op table's `adamw`) with gradient clipping folded
into its grad_scale and the fp32 global gradient norm, against plain torch (clip_grad_norm_ +
unfused AdamW); its state is torch AdamW's, so checkpoints move between the two."""

import pytest
import torch
from loongforge.core.stacks.grads import grad_sq_norm
from loongforge.core.train.optimizer import TableAdamW
from loongforge.core.train.trainer import clipped_step


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in ((7, 5), (11,), (3, 4, 2))]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 3).to(dtype)
    ps.append(torch.nn.Parameter(torch.ones(2, dtype=dtype)))  # no gradient: not counted, not stepped
    return ps


def test_grad_sq_norm_matches_torch():
    ps = _params(torch.bfloat16)
    want = torch.nn.utils.get_total_norm([p.grad.float() for p in ps if p.grad is not None])
    got = grad_sq_norm(ps, "cpu")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.sqrt(), want, rtol=1e-6, atol=0)
    assert grad_sq_norm([torch.nn.Parameter(torch.ones(3))], "cpu") == 0


@pytest.mark.parametrize("clip", [0.0, 1.0, 1e6])
def test_clipped_step_equals_clip_then_adamw(clip):
    """Three steps: clipping active (1.0 is far below the norm), inactive (1e6) or off (0)."""
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = TableAdamW(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(3):
        for a, b in zip(_params(torch.float32, seed=step + 1), zip(ours, ref)):
            for p in b:
                p.grad = None if a.grad is None else a.grad.clone()
        clipped_step(opt, grad_sq_norm(ours, "cpu").sqrt(), clip)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in ref if p.grad is not None], clip)
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if clip == 1.0:  # clipping really changed the update
        unclipped = _params(torch.float32)
        o = torch.optim.AdamW(unclipped, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for a, p in zip(_params(torch.float32, seed=step + 1), unclipped):
                p.grad = None if a.grad is None else a.grad.clone()
            o.step()
        assert not torch.allclose(unclipped[0], ours[0], rtol=1e-5, atol=1e-6)


def test_table_adamw_state_is_torch_adamw_state():
    ours, theirs = _params(torch.float32), _params(torch.float32)
    opt = TableAdamW(ours, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    opt.step()
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    torch_opt.load_state_dict(opt.state_dict())
    back = TableAdamW(_params(torch.float32), lr=1.0)
    back.load_state_dict(torch_opt.state_dict())
    st = back.state_dict()["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and float(st["step"]) == 1.0
    torch.testing.assert_close(st["exp_avg"], opt.state[ours[0]]["exp_avg"])
    assert back.param_groups[0]["lr"] == 1e-2 and back.param_groups[0]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("bad", ["grad", "loss"])
def test_non_finite_step_changes_nothing(bad):
    """The NaN/Inf guard on the device: a step whose gradient norm or loss is not finite leaves the
    parameters, moments and step counts exactly as they were; the next finite step updates."""
    ps = _params(torch.float32)
    opt = TableAdamW(ps, lr=1e-2, weight_decay=0.1)
    assert float(clipped_step(opt, grad_sq_norm(ps, "cpu").sqrt(), 1.0, torch.tensor(2.0))) == 0.0
    before = [p.detach().clone() for p in ps]
    state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(ps) if p in opt.state}
    if bad == "grad":
        ps[0].grad[1, 2] = float("nan")
    loss = torch.tensor(float("inf") if bad == "loss" else 2.0)
    assert float(clipped_step(opt, grad_sq_norm(ps, "cpu").sqrt(), 1.0, loss)) == 1.0
    for a, b in zip(ps, before):
        assert torch.equal(a, b)
    for i, st in state.items():
        for k, v in st.items():
            assert torch.equal(opt.state[ps[i]][k], v), k
    assert float(opt.state[ps[0]]["step"]) == 1.0
    ps[0].grad = torch.ones_like(ps[0])
    assert float(clipped_step(opt, grad_sq_norm(ps, "cpu").sqrt(), 1.0, torch.tensor(2.0))) == 0.0
    assert not torch.equal(ps[0], before[0]) and float(opt.state[ps[0]]["step"]) == 2.0


def test_ema_follows_the_updates_and_skips_with_them():
    """`ema_decay`: the EMA starts at the parameter before the first update and after every update
    moves `1 - decay` of the way to it; a skipped step (NaN gradient) leaves it as it was."""
    decay = 0.8
    ps = _params(torch.float32)
    opt = TableAdamW(ps, lr=1e-1, weight_decay=0.1, ema_decay=decay)
    want = [p.detach().clone() for p in ps[:3]]
    for step in range(4):
        for a, p in zip(_params(torch.float32, seed=step + 1), ps):
            p.grad = None if a.grad is None else a.grad.clone()
        if step == 2:
            ps[1].grad[0] = float("nan")
        skipped = float(clipped_step(opt, grad_sq_norm(ps, "cpu").sqrt(), 1.0, torch.tensor(1.0)))
        assert skipped == float(step == 2)
        if step != 2:
            want = [decay * w + (1 - decay) * p.detach() for w, p in zip(want, ps)]
        for w, p in zip(want, ps):
            torch.testing.assert_close(opt.state[p]["ema"], w, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(opt.state[ps[0]]["ema"], ps[0])  # it lags the weights
    assert ps[3] not in opt.state  # no gradient, no state
    assert "ema" not in TableAdamW(_params(torch.float32), lr=1e-2).state_dict()["state"].get(0, {})


def test_param_groups_by_lr_scale():
    """A parameter's lr_scale puts it in groups the trainer scales the schedule's rate by."""
    from loongforge.core.stacks.grads import param_groups

    a, b, c = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, 2))
    c.lr_scale = 0.1
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    groups = param_groups([a, b, c, frozen])
    assert [(len(g["params"]), g.get("lr_scale", 1.0), g.get("weight_decay")) for g in groups] == [
        (1, 1.0, None),
        (1, 1.0, 0.0),
        (1, 0.1, None),
        (0, 0.1, 0.0),
    ]
    assert groups[2]["params"][0] is c
