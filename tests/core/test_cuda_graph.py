"""`GraphedCall`: off CUDA it is the function itself; on CUDA (the GPU tests) a replay equals the
eager call, takes new inputs, captures one graph per signature and keeps at most `max_graphs`."""

import pytest
import torch
from loongforge.core.accelerator.cuda_graph import GraphedCall


def affine(x, w):
    return torch.relu(x @ w) + 1.0, x.sum(dim=-1)


def test_off_cuda_runs_the_function():
    calls = []

    def fn(x):
        calls.append(x)
        return x * 2

    g = GraphedCall(fn)
    x = torch.arange(4.0)
    assert torch.equal(g(x), x * 2) and calls == [x] and g.num_graphs == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="argument 1 is a float"):
        GraphedCall(affine)(torch.ones(2, 2), 1.0)
    with pytest.raises(ValueError, match="max_graphs=0"):
        GraphedCall(affine, max_graphs=0)


@pytest.mark.gpu
def test_replay_equals_eager_and_takes_new_inputs():
    torch.manual_seed(0)
    w = torch.randn(64, 32, device="cuda")
    g = GraphedCall(affine, max_graphs=2)
    for shape in ((8, 64), (8, 64), (3, 64)):
        x = torch.randn(*shape, device="cuda")
        got, want = g(x, w), affine(x, w)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert g.num_graphs == 2
    # outputs are the caller's: a later replay does not overwrite them
    x1, x2 = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    first = g(x1, w)[0]
    g(x2, w)
    assert torch.equal(first, affine(x1, w)[0])
    # weights updated in place are read by the replay
    w.mul_(2)
    assert torch.equal(g(x1, w)[0], affine(x1, w)[0])
    # a third signature drops the least recently used one
    g(torch.randn(5, 64, device="cuda"), w)
    assert g.num_graphs == 2
