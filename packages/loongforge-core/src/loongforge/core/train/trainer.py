"""The training loop. A recipe hands the trainer a `TrainingTask` (model, micro-batches, the loss
of one micro-batch as a weighted sum and its weight) and a `TrainStack` (how the model is
parallelized and checkpointed); the trainer owns optimization, loss normalization over the
global batch, clipping, the NaN/Inf guard, evaluation, logging, checkpoints and signals.

    trainer = Trainer(cfg.train, cfg.checkpoint, stack, acc, task, run_config, identity)
    trainer.setup(resume_from)              # model, optimizer, starting weights or resume
    result = trainer.train_step(next(it))   # one optimizer step; device tensors, no host sync
    trainer.save(final=True)

`run` is setup + the loop + the final save. Within a step nothing waits for the device: the
loss, gradient norm and NaN/Inf verdict stay device tensors. The verdict of step k is copied to
the host as step k queues it and read during step k+1, after its forward and backward are queued
(it decides step k+1's learning rate and the bad-step count), waiting for that copy only; values
are read for logging at the log interval only.
"""

from __future__ import annotations

import base64
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from loongforge.core.checkpoint import CheckpointDir, checkpoint_manifest, read_manifest, verify_files
from loongforge.core.errors import UserError
from loongforge.core.ops import OpTable
from loongforge.core.parallel import on_rank0
from loongforge.core.stacks.base import TrainStack
from loongforge.core.train.lr import lr_at
from loongforge.core.train.metrics import Metrics
from loongforge.core.train.optimizer import TableAdamW
from loongforge.core.train.task import TrainingTask


class TrainingStopped(UserError):
    """Training cannot go on (repeated NaN/Inf); the newest good checkpoint is kept."""


@dataclass
class StepResult:
    """One optimizer step, as device tensors (read them at the log interval, not every step)."""

    loss: torch.Tensor  # global weighted mean
    weight: torch.Tensor  # global sum of weights
    grad_norm: torch.Tensor  # of the normalized gradient, before clipping
    skipped: torch.Tensor  # 1.0 where the NaN/Inf guard skipped the update
    lr: float
    metrics: dict = field(default_factory=dict)  # name -> global weighted mean


class Trainer:
    def __init__(
        self, train_cfg, ckpt_cfg, stack: TrainStack, acc, task: TrainingTask, run_config: dict, identity: str, ops: OpTable | None = None
    ) -> None:
        self.cfg = train_cfg
        self.ckpt_cfg = ckpt_cfg
        self.stack = stack
        self.acc = acc
        self.task = task
        self.ops = ops or OpTable()  # the optimizer's `adamw` and `sum_squares` come from it
        self.run_config = run_config
        self.identity = identity
        self.run_dir = Path(ckpt_cfg.run_dir)
        self.rank0 = dist.get_rank() == 0
        self.state = {"step": 0, "optimizer_steps": 0, "consumed_samples": 0, "bad_steps": 0}
        self.model = None
        self.optimizer = None
        self._select = None
        self._pending: HostCopy | None = None  # the last step's NaN/Inf verdict, not read yet
        self._stop_signal: int | None = None
        self._control = None  # a CPU (gloo) group for the stop flag, so agreeing never waits on the device
        self.log_line = print  # where messages go (`run` sends them above the progress bar)

    # ---- setup -------------------------------------------------------------------------
    def _build_optimizer(self, groups):
        c = self.cfg
        return TableAdamW(
            groups,
            update=self.ops.adamw,
            sum_squares=self.ops.sum_squares,
            lr=c.lr,
            betas=(c.adam_beta1, c.adam_beta2),
            eps=c.adam_eps,
            weight_decay=c.weight_decay,
            ema_decay=c.ema_decay,
        )

    def setup(self, resume_from: Path | None = None, verified: bool = False) -> None:
        """Build the model and optimizer; load the starting weights, or resume from a checkpoint
        (`verified`: its files were already checked against the manifest's checksums)."""
        self.acc.manual_seed(self.cfg.seed)
        self.stack.activation_shape = self.task.activation_shape
        self.model = self.stack.prepare(self.task.build_model())
        if self.task.trainable_only:
            names = {n for n, p in self.model.named_parameters() if p.requires_grad}
            self._select = names.__contains__
        self.optimizer = self.stack.make_optimizer(self.model, self._build_optimizer)
        if resume_from is not None:
            if self.task.trainable_only:
                self.task.initial_weights(self.model, None, self.stack)
            self.load(resume_from, verify=not verified)
            if self.rank0:
                print(f"resumed from {resume_from} at step {self.state['step']}", flush=True)
        else:
            self.state["inherited_optimizer_steps"] = self.task.initial_weights(self.model, self.optimizer, self.stack) or 0
        self.model.train()
        if dist.get_world_size() > 1 and dist.get_backend() != "gloo":
            self._control = dist.new_group(backend="gloo")

    # ---- one step ----------------------------------------------------------------------
    def train_step(self, microbatches) -> StepResult:
        """Forward, backward and the optimizer update of one global batch (this rank's
        micro-batches): the loss is sum(weighted sums) / sum(weights) over the whole batch."""
        model, opt, stack = self.model, self.optimizer, self.stack
        stack.zero_grad(model, opt)
        s, w, metrics = stack.forward_backward(model, microbatches, self.task.loss)
        totals = stack.all_reduce_dp(torch.stack([s, w, *metrics.values()]))
        stack.finalize_grads(model, opt)
        # the gradients are now the data-parallel mean of the local weighted sums' gradients:
        # dividing them by weight / dp_size gives the gradient of the global weighted mean
        weight = totals[1].clamp(min=1e-12)
        divisor = weight / stack.dp_size
        loss = totals[0] / weight
        grad_norm = stack.grad_sq_norm(model, opt).sqrt() / divisor
        self._resolve_pending()
        lr = lr_at(self.state["optimizer_steps"], self.cfg)
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        skipped = clipped_step(opt, grad_norm, self.cfg.clip_grad, loss, divisor)
        stack.after_step(model, opt)
        self._pending = HostCopy(skipped)
        self.state["step"] += 1
        self.state["consumed_samples"] += self.cfg.global_batch_size
        return StepResult(loss, totals[1], grad_norm, skipped, lr, {k: totals[2 + i] / weight for i, k in enumerate(metrics)})

    def _resolve_pending(self) -> None:
        """Read the previous step's NaN/Inf verdict (by now its update is done or queued behind
        work already on the device) into the step counters."""
        if self._pending is None:
            return
        bad = bool(self._pending.get())
        self._pending = None
        st = self.state
        if not bad:
            st["bad_steps"] = 0
            st["optimizer_steps"] += 1
            return
        st["bad_steps"] += 1
        if self.rank0:
            self.log_line(f"step {st['step']}: non-finite loss or gradient, update skipped ({st['bad_steps']}/{self.cfg.max_bad_steps})")
        if st["bad_steps"] >= self.cfg.max_bad_steps:
            raise TrainingStopped(
                f"stopped at step {st['step']}: {st['bad_steps']} consecutive steps with NaN/Inf loss or gradient; "
                "lower train.lr, raise train.lr_warmup_iters or check the data"
            )

    # ---- evaluation --------------------------------------------------------------------
    def evaluate(self) -> float | None:
        batches = self.task.eval_batches()
        if batches is None:
            return None
        self.model.eval()
        total = None
        with torch.no_grad():
            for mbs in batches:
                s, w, _ = self.stack.forward_backward(self.model, mbs, self.task.loss, forward_only=True)
                total = torch.stack([s, w]) if total is None else total + torch.stack([s, w])
        self.model.train()
        if total is None:
            return None
        total = self.stack.all_reduce_dp(total)
        return float(total[0] / total[1].clamp(min=1e-12))

    # ---- checkpoints -------------------------------------------------------------------
    def save(self, final: bool = False) -> Path:
        self._resolve_pending()
        step = self.state["step"]
        ckdir = CheckpointDir(self.run_dir)
        tmp = ckdir.tmp_dir(step)
        if self.rank0:
            ckdir.begin(step)
        dist.barrier()
        try:
            self.stack.save(tmp, self.model, self.optimizer, self._select)
        except BaseException:
            # (a full disk, say): the unfinished step goes, the newest checkpoint stays as it was
            if self.rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        dist.barrier()

        def commit():
            rng = {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in self.acc.rng_state().items()}
            manifest = checkpoint_manifest(
                self.identity, self.run_config, self.stack.layout(), dict(self.state), rng, trainable_only=self.task.trainable_only
            )
            final_dir = ckdir.commit(tmp, step, manifest, self.ckpt_cfg.keep_last)
            self.task.on_saved(final_dir, final)

        on_rank0(commit)
        return ckdir.root / ckdir.step_name(step)

    def load(self, step_dir: Path, verify: bool = True) -> None:
        if verify:
            on_rank0(lambda: verify_files(step_dir))
        m = read_manifest(step_dir)
        saved = m.get("parallel", {}).get("stack")
        if saved is not None and saved != self.stack.name:  # the two stacks' checkpoint formats differ
            raise UserError(f"{step_dir} was written with parallel.stack={saved}; resume this run with parallel.stack={saved}")
        self.state = dict(m["trainer"])
        adam_steps = self.state["optimizer_steps"] + self.state.get("inherited_optimizer_steps", 0)
        self.stack.load(step_dir, self.model, self.optimizer, optimizer_steps=adam_steps, select=self._select)
        rng = {k: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8) for k, v in m["rng"].items()}
        self.acc.set_rng_state({k: v for k, v in rng.items() if k == "cpu" or self.acc.device_type == "cuda"})

    # ---- the loop ----------------------------------------------------------------------
    def run(self, resume_from: Path | None = None, verified: bool = False) -> dict:
        cfg = self.cfg
        self.setup(resume_from, verified)
        old_handlers = self._install_signals()
        metrics = Metrics(self.run_dir, cfg.train_iters, self.state["step"], enabled=self.rank0)
        batches = self.task.batches(self.state["step"])
        last_saved = self.state["step"] if resume_from is not None else -1
        window = _Window(self.acc, self.state["step"])
        self.log_line = metrics.write
        try:
            while self.state["step"] < cfg.train_iters:
                window.add(self.train_step(next(batches)))
                step = self.state["step"]
                record = None
                if step % cfg.log_interval == 0 or step == cfg.train_iters:
                    record = window.close(step, self.task, self.acc.peak_flops(), dist.get_world_size())
                paused = time.perf_counter()  # evaluation and saving do not count as step time
                if cfg.eval_interval and step % cfg.eval_interval == 0:
                    eval_loss = self.evaluate()
                    if eval_loss is not None:
                        metrics.write(f"step {step}: eval loss {eval_loss:.4f}")
                        record = (record or {"step": step}) | {"eval_loss": eval_loss}
                if record is not None:
                    metrics.log(record)
                metrics.advance()
                stop = self._agree_stop()
                if (cfg.save_interval and step % cfg.save_interval == 0) or stop:
                    self.save(final=False)
                    last_saved = step
                if stop:
                    metrics.write(f"signal {stop}: saved step {step}, stopping")
                    raise SystemExit(128 + stop)
                window.t0 += time.perf_counter() - paused
            self._resolve_pending()
            if last_saved != self.state["step"]:
                self.save(final=True)
            else:
                on_rank0(lambda: self.task.on_saved(CheckpointDir(self.run_dir).latest(), True))
        finally:
            self.log_line = print
            metrics.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
        return self.state

    def _install_signals(self):
        def handler(signum, frame):
            self._stop_signal = signum

        return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def _agree_stop(self) -> int:
        """The largest stop signal any rank received (a CPU collective: no device wait)."""
        if dist.get_world_size() == 1:
            return self._stop_signal or 0
        flag = torch.tensor([self._stop_signal or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control)
        return int(flag.item())


class _Window:
    """The steps since the last log line: their results stay on the device until the line is
    written, then one wait gives their mean loss and the interval's step time."""

    def __init__(self, acc, step: int) -> None:
        self.acc = acc
        self.restart(step)

    def restart(self, step: int) -> None:
        self.acc.synchronize()
        self.results: list[StepResult] = []
        self.start_step = step
        self.t0 = time.perf_counter()
        self.acc.reset_peak_memory()

    def add(self, result: StepResult) -> None:
        self.results.append(result)

    def close(self, step: int, task: TrainingTask, peak: float | None, world: int) -> dict:
        self.acc.synchronize()
        dt = (time.perf_counter() - self.t0) / max(1, step - self.start_step)
        rs = self.results
        last = rs[-1]
        losses = torch.stack([r.loss for r in rs]).float().cpu()
        record = {
            "step": step,
            "loss": float(losses.mean()),
            "lr": last.lr,
            "grad_norm": float(last.grad_norm),
            f"{task.unit}_per_s": task.units_per_step / dt,
            "step_time_s": dt,
            "flops_per_step": task.flops_per_step or None,
            "mfu": task.flops_per_step / dt / (peak * world) if peak and task.flops_per_step else None,
            "skipped": int(torch.stack([r.skipped for r in rs]).sum()),
            **{k: float(v) for k, v in last.metrics.items()},
            **self.acc.memory_stats(),
        }
        self.restart(step)
        return record


class HostCopy:
    """A device tensor copied to the host without waiting: `get()` waits for that copy only.
    (`bool(t)` or `t.item()` would wait for everything queued on the stream since, such as the
    next step's forward and backward, and leave the device idle while the host catches up.)"""

    def __init__(self, t: torch.Tensor) -> None:
        self._event = None
        if t.device.type == "cpu":
            self._host = t
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        self._event = torch.Event(device=t.device)
        self._event.record()

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host


def clipped_step(
    optimizer: torch.optim.Optimizer,
    grad_norm: torch.Tensor,
    clip: float,
    loss: torch.Tensor | None = None,
    divisor: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """One step of an optimizer that honours `grad_scale` and `found_inf` (TableAdamW, torch's fused
    optimizers) on the gradients divided by `divisor` (the loss normalization) and scaled by
    min(1, clip / (norm + 1e-6)) (unclipped when clip <= 0), skipped where the gradient norm or
    `loss` is NaN/Inf. Both go in as the optimizer's attributes (torch's contract with its
    GradScaler: the update divides each gradient by `grad_scale` as it reads it and leaves
    everything as it was where `found_inf` is nonzero), so neither normalization, clipping nor the
    guard costs a pass over the gradients or a host sync. Returns `found_inf` (fp32 0-d, on the
    device): 1.0 where the step was skipped."""
    bad = ~torch.isfinite(grad_norm)
    if loss is not None:
        bad |= ~torch.isfinite(loss)
    scale = torch.clamp((grad_norm.float() + 1e-6) / clip, min=1.0) if clip > 0 else None
    if not (isinstance(divisor, float) and divisor == 1.0):
        scale = divisor if scale is None else scale * divisor
    optimizer.grad_scale = scale
    optimizer.found_inf = bad.float()
    optimizer.step()
    return optimizer.found_inf
