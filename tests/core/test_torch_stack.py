"""The torch-native stack (DDP, ZeRO-1, FSDP2, HSDP on an HF Llama) against one process.

One 2-process job (gloo, CPU, run with torch.distributed.run on this file) trains every mode on
the same global batch, each rank taking half its rows, and writes checkpoints; this process
holds the one-process reference run, resumes, and loads the 2-process checkpoints (and the
2-process job loads this process's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from loongforge.core.checkpoint.dcp_io import read_model_state
from loongforge.core.config.schema import ParallelConfig
from loongforge.core.errors import UserError
from loongforge.core.foundation.families import LLAMA
from loongforge.core.foundation.hf_native import build_hf_causal_lm
from loongforge.core.foundation.spec import ModelConfig
from loongforge.core.ops import OpTable
from loongforge.core.parallel import free_port
from loongforge.core.stacks.torch_native import TorchNativeStack, recompute_block
from loongforge.core.train.optimizer import TableAdamW

CFG = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176, vocab_size=128, max_position_embeddings=64
)
ROWS, SEQ, STEPS, LR, CLIP, EMA = 4, 16, 4, 1e-2, 1.0, 0.5
# (mode, data_parallel_replicas, micro-batches per rank) of the 2-process runs
MODES = {"ddp": ("ddp", 1, 1), "zero1": ("zero1", 1, 2), "fsdp": ("fsdp", 1, 2), "hsdp_2x1": ("hsdp", 2, 1), "hsdp_1x2": ("hsdp", 1, 2)}


def make_model():
    torch.manual_seed(0)
    return build_hf_causal_lm(LLAMA, CFG, OpTable())


def other_model():
    """Weights other than `make_model`'s, to load as HF weights."""
    torch.manual_seed(5)
    return build_hf_causal_lm(LLAMA, CFG, OpTable())


def microbatches(rank: int, world: int, n: int) -> list[dict]:
    """This rank's share of the one global batch (contiguous rows), in `n` micro-batches."""
    seq = torch.randint(0, CFG.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    rows = seq[rank * ROWS // world : (rank + 1) * ROWS // world]
    return [{"tokens": r[:, :-1], "labels": r[:, 1:]} for r in rows.chunk(n)]


def loss_fn(model, mb):
    w = torch.ones(mb["labels"].shape)
    return model(mb["tokens"], mb["labels"], w), w.sum(), {}


class Run:
    """A model, optimizer and stack, and the training step the trainer takes: gradients are
    the per-rank sums, divided by the global weight / dp size and clipped via `grad_scale`."""

    def __init__(self, mode: str, replicas: int = 1, n_mb: int = 1, ema: float = EMA, **stack_kw) -> None:
        self.stack = TorchNativeStack(
            ParallelConfig(stack="torch", data_parallel_mode=mode, data_parallel_replicas=replicas), torch.device("cpu"), **stack_kw
        )
        self.model = self.stack.prepare(make_model())
        self.opt = self.stack.make_optimizer(
            self.model, lambda groups: TableAdamW(groups, lr=LR, weight_decay=0.1, betas=(0.9, 0.95), ema_decay=ema)
        )
        self.mbs = microbatches(self.stack.dp_rank, self.stack.dp_size, n_mb)

    def step(self) -> float:
        st = self.stack
        st.zero_grad()
        s, w, _ = st.forward_backward(self.model, self.mbs, loss_fn)
        st.all_reduce_dp(s)
        st.all_reduce_dp(w)
        st.finalize_grads(self.model, self.opt)
        per_rank = w / st.dp_size  # the gradients are the mean over ranks of per-rank sums
        norm = st.grad_sq_norm(self.model, self.opt).sqrt() / per_rank
        self.opt.grad_scale = per_rank * torch.clamp((norm + 1e-6) / CLIP, min=1.0)
        self.opt.found_inf = torch.zeros(())
        self.opt.step()
        st.after_step(self.model, self.opt)
        return float(s / w)

    def train(self, n: int) -> list[float]:
        return [self.step() for _ in range(n)]

    def full(self) -> dict:
        return {k: v.clone() for k, v in self.stack.full_state_dict(self.model).items()}


def close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


# ---- the 2-process job -----------------------------------------------------------------------
def worker(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    res = {}
    for key, (mode, replicas, n_mb) in MODES.items():
        run = Run(mode, replicas, n_mb)
        losses = run.train(2)
        if mode in ("fsdp", "zero1"):
            run.stack.save(out / f"{mode}2", run.model, run.opt)
            res[f"{mode}_full2"] = run.full()
        res[key] = losses + run.train(STEPS - 2)
        if mode == "fsdp":
            run.stack.save(out / f"{mode}{STEPS}", run.model, run.opt)
    resumed = Run("fsdp", 1, 2)
    resumed.stack.load(out / "fsdp2", resumed.model, resumed.opt, optimizer_steps=2)
    res["fsdp_resumed"] = resumed.train(STEPS - 2)
    resumed.stack.save(out / f"fsdp_resumed{STEPS}", resumed.model, resumed.opt)
    from_one = Run("fsdp", 1, 1)
    from_one.stack.load(out / "single2", from_one.model, from_one.opt, optimizer_steps=2)
    res["from_single"] = from_one.train(STEPS - 2)
    hf_run = Run("fsdp")
    hf_run.stack.load_full_state_dict(hf_run.model, hf_run.model.state_from_hf(other_model().hf_state_dict()))
    res["hf_into_fsdp"] = hf_run.full()
    if dist.get_rank() == 0:
        torch.save(res, out / "multi.pt")
    dist.barrier()
    dist.destroy_process_group()


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pg():
    """A one-process gloo group for this process (reused where another test made one)."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield
    if made:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single(pg, tmp_path_factory):
    """The one-process reference over all rows (2 micro-batches), checkpointed after step 2."""
    d = tmp_path_factory.mktemp("torch_stack")
    run = Run("ddp", 1, 2)
    first = run.train(2)
    run.stack.save(d / "single2", run.model, run.opt)
    return {"dir": d, "losses": first + run.train(STEPS - 2)}


@pytest.fixture(scope="module")
def multi(single):
    d = single["dir"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), __file__, str(d)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return torch.load(d / "multi.pt")


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_data_parallel_modes_match_one_process(single, multi):
    ref = single["losses"]
    assert all(b < a for a, b in zip(ref, ref[1:])), ref  # it trains (a check that can fail)
    for key in MODES:
        assert close(multi[key], ref, 1e-5), (key, multi[key], ref)


@pytest.mark.slow
def test_resume_is_exact(single, multi):
    run = Run("ddp", 1, 2)
    run.stack.load(single["dir"] / "single2", run.model, run.opt, optimizer_steps=2)
    assert close(run.train(STEPS - 2), single["losses"][2:], 1e-6)
    assert close(multi["fsdp_resumed"], multi["fsdp"][2:], 1e-6), (multi["fsdp_resumed"], multi["fsdp"])


@pytest.mark.slow
@pytest.mark.parametrize("mode,into", [("fsdp", "fsdp"), ("zero1", "ddp")])
def test_two_process_checkpoint_loads_in_one(single, multi, mode, into):
    run = Run(into, 1, 2)
    run.stack.load(single["dir"] / f"{mode}2", run.model, run.opt, optimizer_steps=2)
    full, want = run.full(), multi[f"{mode}_full2"]
    assert full.keys() == want.keys()
    assert all(torch.equal(full[k], want[k]) for k in want)
    read = read_model_state(single["dir"] / f"{mode}2")  # what an HF export reads, without a model
    assert read.keys() == want.keys() and all(torch.equal(read[k], want[k]) for k in want)
    losses = run.train(STEPS - 2)
    assert close(losses[:1], multi[mode][2:3], 1e-6) and close(losses, multi[mode][2:], 1e-5), (losses, multi[mode])


@pytest.mark.slow
def test_ema_in_every_layout(single, multi):
    """The weights' EMA (optimizer state, `ema_decay`) is the same from one process, FSDP2 and
    ZeRO-1 on 2 processes, read from their checkpoints without a model; it continues exactly
    through a resume; a checkpoint without one says so."""
    d = single["dir"]
    want = read_model_state(d / "single2", ema=True)
    weights = read_model_state(d / "single2")
    assert want.keys() == weights.keys() and not torch.allclose(want["hf.lm_head.weight"], weights["hf.lm_head.weight"])
    for mode in ("fsdp", "zero1"):
        got = read_model_state(d / f"{mode}2", ema=True)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=f"{mode} {k}")  # as the weights agree
    straight, resumed = read_model_state(d / f"fsdp{STEPS}", ema=True), read_model_state(d / f"fsdp_resumed{STEPS}", ema=True)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert not torch.equal(straight["hf.lm_head.weight"], want["hf.lm_head.weight"])
    plain = Run("ddp", 1, 1, ema=0.0)
    plain.train(1)
    plain.stack.save(d / "no_ema", plain.model, plain.opt)
    with pytest.raises(UserError, match="no EMA"):
        read_model_state(d / "no_ema", ema=True)


@pytest.mark.slow
def test_one_process_checkpoint_loads_in_fsdp2(single, multi):
    assert close(multi["from_single"], single["losses"][2:], 1e-5), (multi["from_single"], single["losses"])


@pytest.mark.slow
def test_recompute_and_bf16(single, tmp_path):
    """Recompute reruns each block in backward and changes no loss; bf16 with fp32 masters is
    the same under MasterWeights (ddp) and FSDP's MixedPrecisionPolicy, near fp32, and
    checkpoints fp32 masters; pure bf16 resumes exactly from its fp32 checkpoint."""
    run = Run("fsdp", 1, 2, recompute=True)
    calls = []
    run.model.hf.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    assert close(run.train(2), single["losses"][:2], 1e-6)
    assert len(calls) == 2 * 2 * 2  # 2 steps x 2 micro-batches x (forward + recompute)
    bf16 = {mode: Run(mode, 1, 2, params_dtype=torch.bfloat16) for mode in ("ddp", "fsdp")}
    losses = {mode: r.train(2) for mode, r in bf16.items()}
    assert close(losses["fsdp"], losses["ddp"], 1e-5) and close(losses["ddp"], single["losses"][:2], 1e-2)
    assert next(bf16["ddp"].model.parameters()).dtype == torch.bfloat16
    bf16["ddp"].stack.save(tmp_path / "masters", bf16["ddp"].model, bf16["ddp"].opt)
    fp32 = Run("ddp", 1, 2)
    fp32.stack.load(tmp_path / "masters", fp32.model, fp32.opt, optimizer_steps=2)
    masters = bf16["fsdp"].full()
    assert all(v.dtype == torch.float32 for v in masters.values())
    assert all(torch.equal(v, masters[k]) for k, v in fp32.full().items())
    pure = Run("zero1", 1, 2, params_dtype=torch.bfloat16, master_weights=False)
    pure.train(2)
    pure.stack.save(tmp_path / "pure", pure.model, pure.opt)
    want = pure.train(2)
    again = Run("zero1", 1, 2, params_dtype=torch.bfloat16, master_weights=False)
    again.stack.load(tmp_path / "pure", again.model, again.opt, optimizer_steps=2)
    assert again.train(2) == want


def test_recompute_block_checkpoints_only_under_autograd(monkeypatch):
    """A recomputed block's forward goes through the checkpoint where autograd records (and its
    gradients equal the plain block's); under no_grad it runs the block plainly."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    block.load_state_dict(plain.state_dict())
    recompute_block(block)
    runs, checkpoints = [], []
    block[0].register_forward_pre_hook(lambda *a: runs.append(1))
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: checkpoints.append(1) or real(*a, **k))
    x = torch.randn(4, 8)
    block(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert (len(runs), len(checkpoints)) == (2, 1)  # forward + recompute, through one checkpoint
    for got, want in zip(block.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(block(x), plain(x), rtol=0, atol=0)
    assert (len(runs), len(checkpoints)) == (3, 1)


@pytest.mark.slow
def test_load_full_state_dict(multi):
    """HF weights into a prepared model: sharded by FSDP=2, into the fp32 masters under bf16
    ddp; a name the model lacks is a UserError."""
    want = other_model().state_dict()
    assert all(torch.equal(v, want[k]) for k, v in multi["hf_into_fsdp"].items()) and multi["hf_into_fsdp"].keys() == want.keys()
    run = Run("ddp", params_dtype=torch.bfloat16)
    run.stack.load_full_state_dict(run.model, other_model().hf_state_dict())  # HF names are taken as they are
    assert all(torch.equal(v, want[k]) for k, v in run.full().items())
    assert torch.equal(run.model.hf.model.norm.weight, want["hf.model.norm.weight"].bfloat16())
    with pytest.raises(UserError, match="extra"):
        run.stack.load_full_state_dict(run.model, {**want, "extra": torch.zeros(1)})


def test_select_limits_checkpoint(pg, tmp_path):
    """`select` (trainable-only checkpoints): only the chosen tensors and their AdamW state are
    written and read; the rest keeps the loading model's values."""
    from torch.distributed.checkpoint import FileSystemReader

    def select(name):
        return "norm" in name

    run = Run("ddp")
    run.train(1)
    run.stack.save(tmp_path / "sel", run.model, run.opt, select=select)
    keys = FileSystemReader(str(tmp_path / "sel")).read_metadata().state_dict_metadata
    assert keys and all("norm" in k for k in keys)
    fresh = Run("ddp")
    init = fresh.full()
    fresh.stack.load(tmp_path / "sel", fresh.model, fresh.opt, optimizer_steps=1, select=select)
    trained, now = run.full(), fresh.full()
    assert all(torch.equal(now[k], trained[k] if select(k) else init[k]) for k in now)
    assert not torch.equal(trained["hf.model.norm.weight"], init["hf.model.norm.weight"])
    for name, p in fresh.model.named_parameters():
        st = fresh.opt.state[p]
        assert float(st["step"]) == 1.0 and bool(st["exp_avg"].abs().sum() > 0) == select(name), name


def test_hf_model_loss_and_state_round_trip(tmp_path):
    import transformers
    from loongforge.core.foundation.hf_io import load_hf_state, save_hf

    model = make_model()
    tokens = torch.randint(0, CFG.vocab_size, (2, SEQ))
    labels = torch.randint(0, CFG.vocab_size, (2, SEQ))
    weights = torch.rand(2, SEQ)
    with torch.no_grad():
        logits = model(tokens)
        want = (F.cross_entropy(logits.reshape(-1, CFG.vocab_size), labels.reshape(-1), reduction="none") * weights.reshape(-1)).sum()
        got = model(tokens, labels, weights)
    assert logits.shape == (2, SEQ, CFG.vocab_size)
    assert torch.allclose(got, want, rtol=1e-5)
    hf = model.hf_state_dict()
    assert hf.keys() == model.hf.state_dict().keys()
    other = build_hf_causal_lm(LLAMA, CFG, OpTable())  # other random weights
    other.load_hf_state_dict(hf)
    assert all(torch.equal(v, other.hf_state_dict()[k]) for k, v in hf.items())
    save_hf(tmp_path / "hf", LLAMA, LLAMA.resolve(CFG), hf)  # an export HF itself loads
    assert all(torch.equal(v, hf[k]) for k, v in load_hf_state(tmp_path / "hf").items())
    with torch.no_grad():
        assert torch.equal(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(tokens).logits, logits)
    with pytest.raises(UserError, match="model.norm.weight"):
        other.load_hf_state_dict({k: v for k, v in hf.items() if k != "model.norm.weight"})
    with pytest.raises(UserError, match="extra.weight"):
        other.load_hf_state_dict({**hf, "extra.weight": torch.zeros(1)})


def test_bad_parallel_config(pg):
    with pytest.raises(UserError, match="data_parallel_mode"):
        TorchNativeStack(ParallelConfig(stack="torch", data_parallel_mode="zero3"), torch.device("cpu"))
    with pytest.raises(UserError, match="data_parallel_replicas"):
        TorchNativeStack(ParallelConfig(stack="torch", data_parallel_mode="hsdp", data_parallel_replicas=2), torch.device("cpu"))
    with pytest.raises(UserError, match="tensor_model_parallel_size"):
        TorchNativeStack(ParallelConfig(stack="torch", tensor_model_parallel_size=2, data_parallel_mode="fsdp"), torch.device("cpu"))


if __name__ == "__main__":  # the 2-process job, under torch.distributed.run
    worker(Path(sys.argv[1]))


def test_grad_norm_runs_through_the_optimizers_sum_squares(pg):
    """The stack's squared gradient norm is the optimizer's `sum_squares` (the op table's, which
    the trainer hands it) over every gradient: the same value as torch's clip_grad_norm_."""
    run = Run("ddp")
    calls = []

    def spy(tensors):
        calls.append(len(tensors))
        return OpTable().sum_squares(tensors)

    run.opt.sum_squares = spy
    s, _, _ = run.stack.forward_backward(run.model, run.mbs, loss_fn)
    got = run.stack.grad_sq_norm(run.model, run.opt).sqrt()
    want = torch.nn.utils.clip_grad_norm_([p for p in run.model.parameters() if p.grad is not None], float("inf"))
    assert calls == [sum(p.grad is not None for p in run.model.parameters())]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
