"""The training loop. A recipe fills `TrainHooks` (how to build the model stage, where batches
come from, what to do with a finished checkpoint); the trainer owns optimization, gradient
sync, clipping, the NaN/Inf guard, evaluation, logging, checkpoints and signal handling."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from loongforge.core.checkpoint import CheckpointDir, load_megatron, read_manifest, save_megatron, verify_files
from loongforge.core.errors import UserError
from loongforge.core.ops import OpTable
from loongforge.core.parallel import on_rank0
from loongforge.core.train.lr import lr_at
from loongforge.core.train.metrics import Metrics
from loongforge.core.train.optimizer import TableAdamW
from loongforge.core.train.pipeline import forward_backward
from loongforge.core.train.precision import MasterWeights, PureLowPrecision, resolve_params_dtype


class TrainingStopped(UserError):
    """Training cannot go on (repeated NaN/Inf); the newest good checkpoint is kept."""


@dataclass
class TrainHooks:
    build: Callable[[], torch.nn.Module]  # this rank's model stage, on the device
    # first step -> micro-batch lists, one per step; each micro-batch has tokens, labels and
    # loss_weights (see pipeline.forward_backward)
    batches: Callable[[int], Iterator[list[dict]]]
    act_shape: tuple[int, ...]  # activation shape passed between pipeline stages
    tokens_per_step: int  # tokens in one global batch
    flops_per_token: float  # model FLOPs per trained token (forward + backward)
    eval_batches: Optional[Callable[[], Iterable[list[dict]]]] = None
    # (model, optimizer): starting weights, and optionally optimizer state, then returns how many
    # optimizer steps that state has seen (0 for none); run unless resuming
    initial_weights: Optional[Callable[[torch.nn.Module, torch.optim.Optimizer], int]] = None
    on_saved: Optional[Callable[[Path, bool], None]] = None  # (step dir, final) on rank 0
    # Checkpoints hold only the trainable tensors (LoRA adapters); the frozen rest comes from
    # `initial_weights`, which then runs on resume too.
    save_trainable_only: bool = False
    ops: OpTable = field(default_factory=OpTable)  # the run's op table (the optimizer's `adamw` comes from it)


def fingerprint(run_identity: dict) -> str:
    return hashlib.sha256(json.dumps(run_identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def prepare_run_dir(ckpt_cfg, identity: str) -> Path | None:
    """Decide what `run_dir` holds before anything is built: the checkpoint to resume, None for a
    fresh start, or a refusal when it holds another run's checkpoints."""
    ckdir = CheckpointDir(ckpt_cfg.run_dir)
    latest = ckdir.latest()
    if latest is None:
        return None
    m = read_manifest(latest)
    if m.get("run_identity") == identity or ckpt_cfg.resume:
        return latest
    if ckpt_cfg.overwrite:
        return None
    raise UserError(
        f"{ckpt_cfg.run_dir} holds checkpoints of another run (newest {latest.name}); "
        "set checkpoint.resume=true to continue from them, checkpoint.overwrite=true to move them aside, or pick a new checkpoint.run_dir"
    )


class Trainer:
    def __init__(self, train_cfg, ckpt_cfg, ctx, acc, hooks: TrainHooks, run_config: dict, identity: str) -> None:
        self.cfg = train_cfg
        self.ckpt_cfg = ckpt_cfg
        self.ctx = ctx
        self.acc = acc
        self.hooks = hooks
        self.run_config = run_config
        self.identity = identity
        self.run_dir = Path(ckpt_cfg.run_dir)
        self.rank0 = dist.get_rank() == 0
        self._stop_signal: int | None = None
        self._select = None
        self.params_dtype = resolve_params_dtype(train_cfg.params_dtype, acc)
        self.low_precision: MasterWeights | PureLowPrecision | None = None

    def _trainable_names(self, model) -> None:
        if self.hooks.save_trainable_only:
            names = {n for n, p in model.named_parameters() if p.requires_grad}
            self._select = names.__contains__

    # ---- setup -------------------------------------------------------------------------
    def _optimizer(self, model):
        decay, no_decay = [], []
        for p in model.parameters():
            if p.requires_grad:
                (no_decay if p.dim() < 2 else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return TableAdamW(groups, update=self.hooks.ops.adamw, lr=self.cfg.lr, betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
                          eps=self.cfg.adam_eps)

    def _install_signals(self):
        def handler(signum, frame):
            self._stop_signal = signum

        return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    # ---- gradients ---------------------------------------------------------------------
    def _finalize_grads(self, params) -> None:
        ctx = self.ctx
        if ctx.pp_size > 1 and ctx.embedding_group is not None:
            for p in params:
                if getattr(p, "shared_embedding", False) and p.grad is not None:
                    dist.all_reduce(p.grad, group=ctx.embedding_group)
        if ctx.dp_size > 1:
            grads = [p.grad for p in params if p.grad is not None]
            for bucket in _buckets(grads, 1 << 25):
                flat = torch._utils._flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=ctx.dp_group)
                flat /= ctx.dp_size
                for g, f in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                    g.copy_(f)

    @staticmethod
    def _norm_params(params) -> list:
        """The parameters whose gradients count once in the global norm: not the second copy of
        a shared embedding, not a TP-duplicated (replicated) one on ranks other than TP rank 0."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        return [p for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]

    def _grad_norm(self, params) -> torch.Tensor:
        sq = grad_sq_norm(params, self.acc.device())
        if self.ctx.tp_size * self.ctx.pp_size > 1:
            dist.all_reduce(sq, group=self.ctx.mp_group)
        return sq.sqrt()

    # ---- checkpoints -------------------------------------------------------------------
    def save(self, model, optimizer, step: int, state: dict, final: bool) -> Path:
        ckdir = CheckpointDir(self.run_dir)
        tmp = ckdir.tmp_dir(step)
        if self.rank0:
            ckdir.begin(step)
        dist.barrier()
        with self._fp32_view():
            save_megatron(tmp, model, optimizer, self._select)
        dist.barrier()
        path = ckdir.root / ckdir.step_name(step)

        def commit():
            manifest = {
                "run_identity": self.identity,
                "config": self.run_config,
                "parallel": self.ctx.layout(),
                "trainer": state,
                "rng": {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in self.acc.rng_state().items()},
                "torch_version": torch.__version__,
                "trainable_only": self.hooks.save_trainable_only,
            }
            final_dir = ckdir.commit(tmp, step, manifest, self.ckpt_cfg.keep_last)
            if self.hooks.on_saved is not None:
                self.hooks.on_saved(final_dir, final)

        on_rank0(commit)
        return path

    def load(self, model, optimizer, step_dir: Path) -> dict:
        on_rank0(lambda: verify_files(step_dir))
        m = read_manifest(step_dir)
        state = m["trainer"]
        adam_steps = state["optimizer_steps"] + state.get("inherited_optimizer_steps", 0)
        load_megatron(step_dir, model, optimizer, optimizer_steps=adam_steps, select=self._select)
        rng = {k: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8) for k, v in m["rng"].items()}
        self.acc.set_rng_state({k: v for k, v in rng.items() if k == "cpu" or self.acc.device_type == "cuda"})
        return state

    def _fp32_view(self):
        return self.low_precision.fp32_view() if self.low_precision is not None else contextlib.nullcontext()

    # ---- loop --------------------------------------------------------------------------
    def evaluate(self, model) -> float | None:
        if self.hooks.eval_batches is None:
            return None
        model.eval()
        losses = []
        with torch.no_grad():
            for mbs in self.hooks.eval_batches():
                losses.append(self._fb(model, mbs, forward_only=True))
        model.train()
        if not losses:
            return None
        return float(self._dp_mean(torch.stack(losses).mean()))

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.ctx.dp_size > 1:
            dist.all_reduce(value, group=self.ctx.dp_group)
            value /= self.ctx.dp_size
        return value

    def _fb(self, model, mbs, forward_only=False):
        return forward_backward(
            model,
            mbs,
            self.ctx,
            self.hooks.act_shape,
            self.params_dtype,  # activations between pipeline stages travel in the parameters' dtype
            self.acc.device(),
            self.acc.autocast,
            forward_only=forward_only,
        )

    def run(self, resume_from: Path | None) -> dict:
        cfg = self.cfg
        self.acc.manual_seed(cfg.seed)
        model = self.hooks.build()
        self._trainable_names(model)
        optimizer = self._optimizer(model)
        state = {"step": 0, "optimizer_steps": 0, "consumed_samples": 0, "bad_steps": 0}
        if resume_from is not None:
            if self.hooks.save_trainable_only and self.hooks.initial_weights is not None:
                self.hooks.initial_weights(model, None)
            state = self.load(model, optimizer, resume_from)
            if self.rank0:
                print(f"resumed from {resume_from} at step {state['step']}", flush=True)
        elif self.hooks.initial_weights is not None:
            state["inherited_optimizer_steps"] = self.hooks.initial_weights(model, optimizer) or 0
        # the optimizer holds the fp32 parameters it was built over: with low-precision params
        # they become the masters (loaded above at full precision), or are cast themselves
        trained = [p for g in optimizer.param_groups for p in g["params"]]
        counted = self._norm_params(trained)
        if self.params_dtype != torch.float32:
            self.low_precision = (MasterWeights(model, self.params_dtype) if cfg.master_weights
                                  else PureLowPrecision(model, optimizer, self.params_dtype))
        model.train()
        old_handlers = self._install_signals()
        metrics = Metrics(self.run_dir, cfg.train_iters, state["step"], enabled=self.rank0)
        batches = self.hooks.batches(state["step"])
        peak = self.acc.peak_flops()
        last_saved = state["step"] if resume_from is not None else -1
        try:
            while state["step"] < cfg.train_iters:
                step = state["step"]
                t0 = time.perf_counter()
                self.acc.reset_peak_memory()
                mbs = next(batches)
                for p in trained:
                    p.grad = None
                loss = self._dp_mean(self._fb(model, mbs))
                self._finalize_grads(trained)
                grad_norm = self._grad_norm(counted)
                lr = lr_at(state["optimizer_steps"], cfg)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                found_inf = clipped_step(optimizer, grad_norm, cfg.clip_grad, loss)
                if self.low_precision is not None:
                    self.low_precision.copy_to_model()  # unchanged masters after a skipped step
                finite = not bool(found_inf)  # the one wait, while the update runs
                if finite:
                    state["bad_steps"] = 0
                    state["optimizer_steps"] += 1
                else:
                    state["bad_steps"] += 1
                    metrics.write(f"step {step + 1}: non-finite loss or gradient, update skipped ({state['bad_steps']}/{cfg.max_bad_steps})")
                    if state["bad_steps"] >= cfg.max_bad_steps:
                        raise TrainingStopped(
                            f"stopped at step {step + 1}: {state['bad_steps']} consecutive steps with NaN/Inf loss or gradient; "
                            "lower train.lr, raise train.lr_warmup_iters or check the data"
                        )
                self.acc.synchronize()
                dt = time.perf_counter() - t0
                state["step"] += 1
                state["consumed_samples"] += cfg.global_batch_size
                tps = self.hooks.tokens_per_step / dt
                record = {
                    "step": state["step"],
                    "loss": float(loss),
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": tps,
                    "step_time_s": dt,
                    "mfu": (self.hooks.flops_per_token * tps / (peak * dist.get_world_size())) if peak else None,
                    "skipped": not finite,
                    **self.acc.memory_stats(),
                }
                if self.hooks.eval_batches is not None and cfg.eval_interval and state["step"] % cfg.eval_interval == 0:
                    record["eval_loss"] = self.evaluate(model)
                    metrics.write(f"step {state['step']}: eval loss {record['eval_loss']:.4f}")
                if state["step"] % cfg.log_interval == 0 or state["step"] == cfg.train_iters:
                    metrics.log(record)
                metrics.advance()
                stop = self._agree_stop()
                if (cfg.save_interval and state["step"] % cfg.save_interval == 0) or stop:
                    self.save(model, optimizer, state["step"], state, final=False)
                    last_saved = state["step"]
                if stop:
                    metrics.write(f"signal {stop}: saved step {state['step']}, stopping")
                    raise SystemExit(128 + stop)
            if last_saved != state["step"]:
                self.save(model, optimizer, state["step"], state, final=True)
            elif self.hooks.on_saved is not None:
                on_saved = self.hooks.on_saved
                on_rank0(lambda: on_saved(CheckpointDir(self.run_dir).latest(), True))
        finally:
            metrics.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
        return state

    def _agree_stop(self) -> int:
        flag = torch.tensor([self._stop_signal or 0], dtype=torch.int64)
        if dist.get_world_size() > 1:
            if self.acc.device_type != "cpu":
                flag = flag.to(self.acc.device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def grad_sq_norm(params, device) -> torch.Tensor:
    """Sum of squares of the parameters' gradients, in fp32: one fused per-tensor norm launch
    (bf16 gradients are read once and never copied)."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()


def clipped_step(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, clip: float, loss: torch.Tensor | None = None) -> torch.Tensor:
    """One step of an optimizer that honours `grad_scale` and `found_inf` (TableAdamW, torch's fused
    optimizers) on the gradients scaled by min(1, clip / (norm + 1e-6)) (unscaled when clip <= 0),
    skipped where the gradient norm or `loss` is NaN/Inf. Both go in as the optimizer's attributes
    (torch's contract with its GradScaler: the update divides each gradient by `grad_scale` as it
    reads it and leaves everything as it was where `found_inf` is nonzero), so neither clipping nor
    the guard costs a pass over the gradients or a host sync. Returns `found_inf` (fp32 0-d, on the
    device): 1.0 where the step was skipped."""
    bad = ~torch.isfinite(grad_norm)
    if loss is not None:
        bad |= ~torch.isfinite(loss)
    optimizer.grad_scale = torch.clamp((grad_norm.float() + 1e-6) / clip, min=1.0) if clip > 0 else None
    optimizer.found_inf = bad.float()
    optimizer.step()
    return optimizer.found_inf


def _buckets(tensors, size):
    bucket, n = [], 0
    for t in tensors:
        bucket.append(t)
        n += t.numel()
        if n >= size:
            yield bucket
            bucket, n = [], 0
    if bucket:
        yield bucket


def move_aside(run_dir: Path) -> Path | None:
    """`overwrite=true`: keep another run's checkpoints under a new name rather than delete them."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return None
    dest = root.with_name(f"checkpoints.old-{int(time.time())}")
    shutil.move(str(root), str(dest))
    return dest
