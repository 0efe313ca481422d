"""The MoE expert MLP op: the reference (one SwiGLU MLP per expert over its rows) against a
per-token float64 computation, and torch's grouped-GEMM implementation against the reference,
forward and backward, with empty experts and with shapes grouped_mm cannot take."""

import pytest
import torch
import torch.nn.functional as F
from loongforge.core.ops import grouped
from loongforge.core.ops import reference as ref

E, H, FFN = 6, 32, 24


def _inputs(dtype, counts=(5, 0, 9, 3, 0, 7), h=H, ffn=FFN, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), h, generator=g).to(dtype)
    fc1 = (torch.randn(E, 2 * ffn, h, generator=g) / h**0.5).to(dtype)
    fc2 = (torch.randn(E, h, ffn, generator=g) / ffn**0.5).to(dtype)
    return x, counts, fc1, fc2


def _per_token(x, counts, fc1, fc2):
    """Each row on its own, in float64: the definition the op implements."""
    expert = torch.repeat_interleave(torch.arange(E), counts)
    out = []
    for row, e in zip(x.double(), expert.tolist()):
        gate, up = (fc1[e].double() @ row).chunk(2)
        out.append(fc2[e].double() @ (F.silu(gate) * up))
    return torch.stack(out)


def test_reference_is_one_mlp_per_expert():
    x, counts, fc1, fc2 = _inputs(torch.float32)
    torch.testing.assert_close(ref.moe_expert_mlp(x, counts, fc1, fc2).double(), _per_token(x, counts, fc1, fc2), rtol=1e-5, atol=1e-6)
    assert ref.moe_expert_mlp(x[:0], torch.zeros(E, dtype=torch.long), fc1, fc2).shape == (0, H)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_mm_equals_the_reference_forward_and_backward(dtype, tol):
    x, counts, fc1, fc2 = _inputs(dtype)
    assert grouped._grouped_ok(x, fc1, fc2)
    leaves = [t.clone().requires_grad_() for t in (x, fc1, fc2)]
    refs = [t.clone().requires_grad_() for t in (x, fc1, fc2)]
    got = grouped.moe_expert_mlp(leaves[0], counts, leaves[1], leaves[2])
    want = ref.moe_expert_mlp(refs[0], counts, refs[1], refs[2])
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    got.backward(grad)
    want.backward(grad)
    for a, b, name in zip(leaves, refs, ("x", "fc1", "fc2")):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol, msg=name)
    assert fc1.shape[0] == E and float(leaves[1].grad[1].abs().sum()) == 0.0  # expert 1 got no rows


def test_grouped_mm_falls_back_where_it_cannot_run():
    x, counts, fc1, fc2 = _inputs(torch.float32, h=30, ffn=10)  # rows of 120 and 40 bytes
    assert not grouped._grouped_ok(x, fc1, fc2)
    torch.testing.assert_close(grouped.moe_expert_mlp(x, counts, fc1, fc2), ref.moe_expert_mlp(x, counts, fc1, fc2))
    half = [t.half() for t in (x, fc1, fc2)]
    assert not grouped._grouped_ok(*half)
    torch.testing.assert_close(
        grouped.moe_expert_mlp(half[0], counts, half[1], half[2]), ref.moe_expert_mlp(half[0], counts, half[1], half[2])
    )


def test_the_callers_swiglu_is_used():
    """Both forms run the SwiGLU they are given (the model passes its op table's, a fused kernel
    on the GPU): a stand-in that doubles it doubles the output."""
    x, counts, fc1, fc2 = _inputs(torch.float32)

    def doubled(gate_up):
        return 2 * ref.swiglu(gate_up)

    for fn in (grouped.moe_expert_mlp, ref.moe_expert_mlp):
        torch.testing.assert_close(fn(x, counts, fc1, fc2, swiglu=doubled), 2 * fn(x, counts, fc1, fc2))
