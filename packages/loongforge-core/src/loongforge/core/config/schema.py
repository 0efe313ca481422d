"""Config sections every stack shares. Names follow Megatron-LM where it has one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional

from loongforge.core.errors import UserError


def _at_least(prefix: str, obj, name: str, low, hint: str = "") -> None:
    """A UserError naming `prefix+name` unless the value is at least `low` (NaN is not)."""
    value = getattr(obj, name)
    if not value >= low:
        raise UserError(f"{prefix}{name}={value} must be at least {low}{hint}")


@dataclass
class ComponentParallelConfig:
    """One model component's layout (`parallel.components.<name>`); None: the model's global value."""

    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None


MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall")


@dataclass
class ParallelConfig:
    stack: str = "megatron"  # megatron (megatron-core models: TP, PP, DP) | torch (the HF model as-is: DDP, ZeRO-1, FSDP2, HSDP)
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # megatron stack, TP > 1: norms, routers and residuals on 1/TP of the sequence (megatron-core's sequence
    # parallelism; all-gather before and reduce-scatter after the parallel linears); MoE models need it at TP > 1
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1  # megatron stack, MoE models: ranks that split each layer's experts (EP)
    expert_spare_slots: int = 0  # EP > 1: extra expert slots per rank holding copies of the hottest experts (0: no replication)
    expert_replan_interval: int = 20  # steps between replication plans (each from the routing of the steps since the last)
    # megatron stack, MoE models at EP > 1: how tokens reach their experts' ranks: allgather (every rank gathers its EP
    # group's tokens; hot-expert replication) | alltoall (each token is sent only to the ranks holding its experts)
    moe_token_dispatcher_type: str = "allgather"
    ranks_per_node: Optional[int] = None  # replicas stay on the busy rank's node where they can (None: torchrun's LOCAL_WORLD_SIZE)
    data_parallel_mode: str = "ddp"  # torch stack: ddp | zero1 (sharded optimizer state) | fsdp (fully_shard per block) | hsdp
    data_parallel_replicas: int = 1  # torch stack, hsdp: replica groups of the 2-D mesh (shards = world size / replicas)
    compile: bool = False  # torch stack: torch.compile every block
    # torch stack, recipes that support it (diffusion.wan, diffusion.qwen_image): ranks that split each sample's tokens (Ulysses)
    context_parallel_size: int = 1
    components: Dict[str, ComponentParallelConfig] = field(default_factory=dict)  # megatron stack: TP/PP per component (vision, ...)

    def validate(self, prefix: str = "parallel.") -> None:
        if self.moe_token_dispatcher_type not in MOE_TOKEN_DISPATCHERS:
            raise UserError(
                f"{prefix}moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}: choose one of {', '.join(MOE_TOKEN_DISPATCHERS)}"
            )
        if self.moe_token_dispatcher_type == "alltoall" and self.expert_spare_slots:
            raise UserError(
                f"{prefix}expert_spare_slots={self.expert_spare_slots} with {prefix}moe_token_dispatcher_type=alltoall: hot-expert "
                f"replicas run with the all-gather dispatcher; set {prefix}moe_token_dispatcher_type=allgather or {prefix}expert_spare_slots=0"
            )


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_iters: int = 100
    lr: float = 3.0e-4
    min_lr: float = 3.0e-5
    lr_warmup_iters: int = 10
    lr_decay_style: str = "cosine"  # cosine | linear | constant | wsd
    lr_wsd_decay_iters: int = 0  # wsd: length of the final decay phase (0: 10% of train_iters)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0
    ema_decay: float = 0.0  # > 0: also keep an exponential moving average of the weights (openpi trains pi0 with 0.99)
    seed: int = 1234
    recompute: bool = False  # full activation recompute, one layer at a time
    params_dtype: str = "auto"  # auto (bf16 on GPUs, fp32 on CPUs) | float32 | bfloat16
    master_weights: bool = True  # low-precision params: fp32 master weights and gradients (false: pure bf16, as HF .bfloat16() training)
    max_bad_steps: int = 5  # consecutive NaN/Inf steps tolerated (each skipped) before stopping
    log_interval: int = 1
    eval_interval: int = 0  # 0: never
    eval_iters: int = 2
    save_interval: int = 0  # 0: only at the end (and on SIGTERM/SIGINT)

    def validate(self, prefix: str = "train.") -> None:
        """Sizes, intervals and rates a run can use; the loader calls it before anything is built."""
        for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval", "max_bad_steps"):
            _at_least(prefix, self, name, 1)
        _at_least(prefix, self, "save_interval", 0, " (0: save only at the end)")
        _at_least(prefix, self, "eval_interval", 0, " (0: never evaluate)")
        if self.eval_interval > 0:
            _at_least(
                prefix,
                self,
                "eval_iters",
                1,
                f" when {prefix}eval_interval={self.eval_interval} (or set {prefix}eval_interval=0: no evaluation)",
            )
        _at_least(prefix, self, "lr", 0)
        _at_least(prefix, self, "clip_grad", 0, " (0: no clipping)")
        if not 0 <= self.ema_decay < 1:
            raise UserError(f"{prefix}ema_decay={self.ema_decay} must be in [0, 1) (0: no EMA; 0.99 or 0.999 are usual)")


@dataclass
class CheckpointConfig:
    run_dir: str = "runs/default"
    load: Optional[str] = None  # HF model directory or LoongForge checkpoint to start from
    load_optimizer: bool = (
        False  # with a LoongForge checkpoint.load: also take its AdamW state (the step count and LR schedule start fresh)
    )
    resume: bool = False  # continue from run_dir's checkpoints even if the config changed
    overwrite: bool = False  # set another (or a damaged) run in run_dir aside as <run_dir>.previous-<time> and start fresh
    export_hf: bool = True  # write an HF directory at the end of training
    keep_last: int = 0  # 0: keep every checkpoint

    def validate(self, prefix: str = "checkpoint.") -> None:
        _at_least(prefix, self, "keep_last", 0, " (0: keep every checkpoint)")


def validate_sections(cfg, prefix: str = "") -> None:
    """Validate every TrainConfig, CheckpointConfig and ParallelConfig section of a loaded config
    (named by its path, e.g. `train.`), at any depth; `load_config` calls it on what it returns."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, (TrainConfig, CheckpointConfig, ParallelConfig)):
            value.validate(f"{prefix}{f.name}.")
        else:
            validate_sections(value, f"{prefix}{f.name}.")
