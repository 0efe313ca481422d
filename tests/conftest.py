"""Shared test helpers: tiny HF models as oracles, running the real CLIs in subprocesses, and the
AdamW comparison the CPU and GPU kernel tests share."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loongforge.core.parallel import free_port


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


HF_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
    "glm4_moe": "Glm4MoeConfig",
}


def make_hf_model(family: str, out: Path, seed: int = 0, **overrides):
    """A tiny random HF model saved with `save_pretrained`; returns the HF module (eval)."""
    import transformers

    kw = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
        vocab_size=512,
        max_position_embeddings=256,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    cfg = getattr(transformers, HF_CLASSES[family])(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(str(out))
    return model


def perturbed(build, scale: float = 0.02) -> torch.nn.Module:
    """`build()` (a random model, after seeding 0) in eval mode, every parameter moved by noise of
    `scale`: an init's zero biases and unit norms would hide a wrong mapping of them."""
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def spread_router(hf, seed: int = 1) -> None:
    """An HF MoE model's router weights (and DeepSeek-style expert biases) large enough that the
    choice of experts differs between tokens and depends on the bias (HF initializes routers
    with std 0.02, which routes almost uniformly, and the bias at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
            if getattr(gate, "e_score_correction_bias", None) is not None:
                gate.e_score_correction_bias.copy_(0.2 * torch.randn(gate.e_score_correction_bias.shape, generator=g))


def logits_error(hf, ours, x) -> float:
    """Largest difference between HF's and our fp32 logits on tokens `x`, relative to HF's largest."""
    with torch.no_grad():
        want, got = hf(x).logits, ours(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    return float((got - want).abs().max() / want.abs().max())


def assert_greedy_matches_hf(hf, ours, new_tokens: int = 8) -> None:
    prompt = torch.tensor([[5, 17, 33, 2, 90]])
    want = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, new_tokens), want)


def assert_round_trip(hf, hf_dir: Path, tmp_path: Path) -> dict:
    """HF -> LoongForge -> HF gives every tensor bit-identical, and the exported directory loads in
    transformers with the original's logits. Returns the exported config.json."""
    import transformers
    from loongforge.llm.model_io import hf_to_lf, lf_to_hf
    from safetensors.torch import load_file

    hf_to_lf(hf_dir, tmp_path / "lf")
    lf_to_hf(tmp_path / "lf", tmp_path / "back")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    x = torch.randint(0, hf.config.vocab_size, (1, 24))
    with torch.no_grad():
        assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()(x).logits, hf(x).logits)
    return json.loads((tmp_path / "back" / "config.json").read_text())


def cli_env() -> dict:
    env = dict(os.environ)
    env.setdefault("LOONGFORGE_DEVICE", "cpu")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_cli(
    args: list[str],
    nproc: int = 1,
    cwd: Path | None = None,
    timeout: int = 600,
    module: str = "loongforge.llm.cli",
    torchrun: bool = False,
) -> subprocess.CompletedProcess:
    """Run a CLI as a user would: `python -m ...`; with `nproc` > 1, that many such processes with
    the environment torchrun gives its workers (`rank_env`), their stdout and stderr joined in rank
    order, and the first failing rank's exit status (the others are then stopped, as torchrun
    does). The processes are children of the fork server (cli_forkserver.py), which has the heavy
    third-party modules imported, where that is the same as a fresh interpreter; else fresh ones.
    `torchrun=True` starts them through torchrun itself, whose agent process costs a torch import
    more per job; one test runs the CLI so."""
    if nproc == 1:
        return _run_processes(module, args, [{}], cwd, timeout)
    for _ in range(3):
        port = free_port()
        if torchrun:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port)]
            r = subprocess.run([*cmd, "-m", module, *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout)
        else:
            r = _run_processes(module, args, [rank_env(rank, nproc, port) for rank in range(nproc)], cwd, timeout)
        # another process took the free port before the rendezvous bound it (no rank started yet): another port
        if not (r.returncode != 0 and "failed to listen" in r.stderr and "EADDRINUSE" in r.stderr):
            return r
    return r


def rank_env(rank: int, world: int, port: int) -> dict:
    """The variables torchrun sets for worker `rank` of a one-node job of `world` processes (its
    agent's own store aside: rank 0 hosts the rendezvous store at `port`)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # torchrun's default for several workers
    }


_fork_server = None


def _server_for(env: dict):
    """The fork server of this pytest process if it can start a process with `env`, else None.
    LOONGFORGE_TEST_FORKSERVER=0 turns it off; so does a GPU (a CUDA driver that a parent process
    has initialized, as an import may, cannot be used in a forked child)."""
    global _fork_server
    if os.environ.get("LOONGFORGE_TEST_FORKSERVER", "1") == "0" or torch.cuda.is_available():
        return None
    if _fork_server is None:
        import atexit

        from cli_forkserver import ForkServer

        _fork_server = ForkServer(cli_env())
        atexit.register(_fork_server.close)
    return _fork_server if _fork_server.can_run(env) else None


def _run_processes(module: str, args: list[str], extra_envs: list[dict], cwd: Path | None, timeout: float) -> subprocess.CompletedProcess:
    """`python -m module args` once per entry of `extra_envs` (added to `cli_env()`), all at once."""
    import tempfile
    import time

    cmd, base_env = [sys.executable, "-m", module, *args], cli_env()
    with tempfile.TemporaryDirectory() as logs:
        procs, paths = [], []
        for i, extra in enumerate(extra_envs):
            env = {**base_env, **extra}
            out, err = Path(logs) / f"{i}.out", Path(logs) / f"{i}.err"
            paths.append((out, err))
            server = _server_for(env)
            if server is not None:
                procs.append(server.start(module, args, cwd, env, out, err))
            else:
                with open(out, "w") as o, open(err, "w") as e:
                    procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=o, stderr=e))
        deadline, timed_out = time.monotonic() + timeout, False
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        failed = next((p for p in procs if p.returncode), None)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        stdout = "".join(out.read_text(errors="replace") for out, _ in paths)
        stderr = "".join(err.read_text(errors="replace") for _, err in paths)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, failed.returncode if failed is not None else 0, stdout, stderr)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


# A small, fast training config (4-layer Llama from HF weights, seq 32) shared by the LLM tests.
FAST = [
    "train.eval_interval=0",
    "train.log_interval=1",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr_warmup_iters=2",
    "data.seq_length=32",
    "checkpoint.export_hf=false",
]


@pytest.fixture(scope="session")
def hf_llama4(tmp_path_factory) -> Path:
    """A 4-layer tiny HF Llama over the shipped tokenizer's vocabulary (512)."""
    d = tmp_path_factory.mktemp("hf_llama4")
    make_hf_model("llama", d, num_hidden_layers=4)
    return d


# Six alpaca rows of the tiny tokenizer's vocabulary, for the SFT and LoRA tests.
SFT_ROWS = [
    {"instruction": "What is one plus two?", "output": "one plus two is three."},
    {"instruction": "Ada gave the kite to Ben. Who has the kite?", "output": "Ben has the kite."},
    {"instruction": "What is four plus one?", "input": "count on your fingers", "output": "four plus one is five."},
    {"instruction": "What is zero plus zero?", "output": "zero."},
    {"instruction": "Cleo gave the lamp to Dev. Who has the lamp?", "output": "Dev has the lamp, since Cleo gave it away."},
    {"instruction": "What is two plus two?", "output": "two plus two is four."},
]


@pytest.fixture(scope="session")
def rows_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("sft_rows") / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    return f


def decoder_outputs(models: list, packed: bool = False) -> list:
    """Each model's (logits, {name: gradient of mean(logits^2)}) for the same 12 random tokens: two
    sequences, or with `packed` one THD pack of samples of 5, 4 and 3 tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    x = torch.randint(0, models[0].vocab_size, (1 if packed else 2, 12))
    kw = {}
    if packed:
        cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
        kw["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    outs = []
    for m in models:
        logits = m(x, None, None, **kw)
        logits.square().mean().backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters()}))
    return outs


def _adamw_exact(p, m, v, g, step, *, lr, beta1, beta2, weight_decay, eps):
    """One AdamW update (decoupled weight decay, bias corrections) in float64: the exact math
    that an fp32 implementation rounds."""
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
    return p - lr * weight_decay * p - lr / (1 - beta1**step) * m / denom, m, v


def _adamw_bounds(p, m, v, g, step, *, lr, beta1, beta2, eps, dtype, **_):
    """Per-element bounds on how far an update computed in fp32 may land from the exact one,
    from the state before the update, with e the dtype's eps (an fp32 rounding is at most e/2):
    - exp_avg: the fp32 betas, 1 - beta1, the two products and the sum are about 3 roundings of
      S_m = |b1*m| + |(1-b1)*g| (not of the result, which can cancel); bound 4 e * S_m.
    - exp_avg_sq: the same with no cancellation, S_v = b2*v + (1-b2)*g^2; bound 4 e * S_v.
    - param: the weight decay (1.5 e of |p|), the exp_avg error carried through
      step_size/denom, roundings of the bias corrections, sqrt, divisions and the subtraction
      (about 10 e of the update); bound 16 e * (|p| + step_size * S_m / denom).
    In bf16/fp16 the stored value is rounded once more, by at most e of the value, which the
    bounds cover since every S is at least the value it bounds. Every bound also allows one step
    of the dtype's subnormal spacing (tiny * e), the fixed grid values below its smallest normal
    number round to (fp16 moments of small gradients land there)."""
    e = torch.finfo(dtype).eps
    floor = torch.finfo(dtype).tiny * e
    s_m = beta1 * m.abs() + (1 - beta1) * g.abs()
    s_v = beta2 * v + (1 - beta2) * g * g
    denom = s_v.sqrt() / math.sqrt(1 - beta2**step) + eps
    s_p = p.abs() + lr / (1 - beta1**step) * s_m / denom
    return 16 * e * s_p + floor, 4 * e * s_m + floor, 4 * e * s_v + floor


@pytest.fixture
def compare_adamw():
    """`compare_adamw(update, params, steps, device, strict=True)`: three AdamW updates of
    `params` (tensors of one dtype) by `update` (an op-table `adamw`), each from the exact float64
    result of the one before rounded to the dtype (so every implementation starts each update
    from the same state), against the exact update with the bounds of `_adamw_bounds`. Weight
    decay, gradient scale 2, beta2 = 0.999 (1 - fp32(0.999) is 110 fp32 eps below 0.001, so
    the betas' rounding shows); `steps` are the starting step counts (they may differ per
    tensor). Returns {quantity: largest difference as a fraction of its bound}; `strict` fails
    on any element past its bound."""

    def compare(update, params, steps, device, strict=True):
        hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
        dtype = params[0].dtype
        state = [[p.clone() for p in params], [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]]
        steps = [torch.tensor(float(s), device=device) for s in steps]
        worst = dict.fromkeys(("param", "exp_avg", "exp_avg_sq"), 0.0)
        gen = torch.Generator(device=device).manual_seed(0)
        for i in range(3):
            grads = [(torch.randn(p.shape, device=device, generator=gen) * (i + 1)).to(dtype) for p in params]
            torch._foreach_add_(steps, 1)
            ours = [[t.clone() for t in ts] for ts in state]
            update(ours[0], [g.clone() for g in grads], ours[1], ours[2], steps, **hp, grad_scale=torch.tensor(2.0, device=device))
            for j, g in enumerate(grads):
                before = [ts[j].double() for ts in state]
                args = (*before, g.double() / 2, float(steps[j]))
                for k, (name, want, bound) in enumerate(zip(worst, _adamw_exact(*args, **hp), _adamw_bounds(*args, **hp, dtype=dtype))):
                    ratio = ((ours[k][j].double() - want).abs() / bound.clamp_min(1e-300)).max().item()
                    assert not strict or ratio <= 1.0, f"update {i + 1}, tensor {j} {name}: difference {ratio:.2f} x its bound"
                    worst[name] = max(worst[name], ratio)
                    state[k][j] = want.to(dtype)
            assert not torch.equal(ours[0][0], params[0])
        return worst

    return compare


def check_adamw_found_inf(update, device, dtype, large: int) -> None:
    """An op-table `adamw` with `found_inf` = 1 leaves every tensor untouched (one of `large`
    elements, an own launch in the kernel, and a small one); `found_inf` = 0 is the unguarded
    update, bit for bit."""
    gen = torch.Generator(device=device).manual_seed(0)
    base = [[torch.randn(s, device=device, generator=gen).to(dtype) for s in [(large,), (3, 7)]] for _ in range(3)]  # p, g, m
    args = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, grad_scale=torch.tensor(1.5, device=device))
    runs = {}
    for flag in (None, 0.0, 1.0):
        ps, gs, ms = ([t.clone() for t in ts] for ts in base)
        vs = [m * m for m in ms]
        update(
            ps,
            gs,
            ms,
            vs,
            [torch.tensor(3.0, device=device) for _ in ps],
            **args,
            found_inf=None if flag is None else torch.tensor(flag, device=device),
        )
        runs[flag] = ps + ms + vs
    original = base[0] + base[2] + [m * m for m in base[2]]
    assert all(torch.equal(a, b) for a, b in zip(runs[1.0], original))
    assert all(torch.equal(a, b) for a, b in zip(runs[0.0], runs[None]))
    assert not torch.equal(runs[None][0], original[0]) and not torch.equal(runs[None][1], original[1])
