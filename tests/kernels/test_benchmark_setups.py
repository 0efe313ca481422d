"""The kernel benchmark's setups compute the same op before anything is timed on the GPU: its
`agreement` check runs here on the CPU (our kernels under TRITON_INTERPRET, megatron-core's MoE
permute; torch.compile and Liger join on the GPU. Liger's RoPE, run once here under the
interpreter from its wheel, matched the reference exactly in fp32; the interpreter's bf16 gave it
NaNs, so it is not part of this test.)"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch


def _load_benchmark():
    """tools/benchmarks/kernels.py under a name of its own: on sys.path as `kernels` it would
    shadow the `kernels` package that transformers imports."""
    path = Path(__file__).resolve().parents[2] / "tools" / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location("loongforge_kernel_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="Triton kernels need TRITON_INTERPRET=1 on a CPU"
)


@pytest.mark.parametrize("case", ["rope", "moe_top2", "moe_top4"])
def test_benchmark_setups_agree(case):
    make = {
        "rope": lambda: bench.rope_setups(2, 7, 4, 2, 16, "cpu"),
        "moe_top2": lambda: bench.moe_setups(13, 24, 8, 2, "cpu"),
        "moe_top4": lambda: bench.moe_setups(17, 40, 16, 4, "cpu"),
    }[case]
    inputs, grads, setups = make()[:3]
    errors = bench.agreement(setups, inputs, grads, 2e-2)
    assert "loongforge" in errors and (case == "rope" or "megatron-core moe_utils" in errors), errors
    print(case, errors)


def test_agreement_catches_a_different_op():
    """The check fails a setup that computes another op (RoPE in the interleaved layout)."""
    from loongforge.core.ops import reference as ref

    inputs, grads, setups = bench.rope_setups(1, 5, 2, 2, 16, "cpu")
    inv = ref.rope_inv_freq(16, 500000.0)
    pos = torch.arange(5)
    setups["interleaved"] = lambda q, k: ref.rope(q, k, pos, inv, True)
    with pytest.raises(RuntimeError, match="interleaved disagrees"):
        bench.agreement(setups, inputs, grads, 2e-2)


def test_agreement_leaves_out_a_peer_that_cannot_run():
    inputs, grads, setups, _ = bench.moe_setups(5, 8, 4, 2, "cpu")
    setups["broken peer"] = lambda x, probs: x[: len(x) + 99].view(-1, 3)
    assert "broken peer" not in bench.agreement(setups, inputs, grads, 2e-2)


def test_rope_and_moe_rows_run(monkeypatch):
    """The rows' own code (agreement, fwd+bwd steps, the launch-parameter sweeps) runs end to end;
    timing is a GPU's, so here each step runs once and reports 1 ms."""
    steps = []

    def one_run(kernel, shape, name, step, nbytes, copy_gbs, cold=False):
        step()
        steps.append((kernel, name))
        return {"kernel": kernel, "setup": name}

    monkeypatch.setattr(bench, "row", one_run)
    bench.rope_rows([(1, 5, 4, 2, 16)], 1.0, sweep=((2, 1),), device="cpu")
    bench.moe_rows([(9, 24, 4, 2)], 1.0, sweep=(1,), device="cpu")
    assert ("rope q+k fwd", "loongforge 2 heads, 1 warps") in steps and ("moe permute+unpermute fwd kernels", "loongforge 1 warps") in steps
    assert ("moe permute+unpermute fwd+bwd", "megatron-core moe_utils") in steps, steps
