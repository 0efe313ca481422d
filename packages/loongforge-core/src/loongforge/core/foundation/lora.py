"""LoRA adapters: on megatron-core's column- and row-parallel linears, chosen by the layer spec,
and on plain `nn.Linear`s of torch-native models (`add_adapters`, e.g. a policy's Gemma backbone).

A targeted linear is built as `LoRAColumnParallelLinear` / `LoRARowParallelLinear`: megatron's
own class (same `weight`, same sharded checkpoint layout) plus `lora_a` [rank, in] and
`lora_b` [out, rank], output `W x + scale * B (A dropout(x))`, scale = alpha / rank
(alpha / sqrt(rank) with rsLoRA). Under tensor parallelism the adapter follows the base weight:

- column-parallel (W split by output rows): B is split the same way, A is whole on every rank;
  the rank-r activation `A x` enters the TP region through megatron's copy (all-reduce of its
  gradient), so A's gradient is the full one on every rank.
- row-parallel (W split by input columns): A is split by columns, B is whole; `A x` is summed
  over the TP group (megatron's reduce), like the base output.

Adapters are initialized as PEFT does (A uniform in +-1/sqrt(in), B zero) from their own
generator, seeded by the run seed and the linear's global name, so the start depends neither on
the TP/PP layout nor on what the global generator produced before the build. The run seed is
`torch.initial_seed()`, the seed the trainer gives torch (`train.seed`) just before it builds
the model.

A torch-native `LoRALinear` is an `nn.Linear` (its `weight` and `bias` keep their names, so
checkpoints and weight mappings of the base model still apply) with the same two adapters.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import zlib
from dataclasses import dataclass, field
from typing import List

import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError

# The decoder layer's linears: megatron name -> the HF linears it fuses.
LINEARS = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
COLUMN_PARALLEL = ("self_attention.linear_qkv", "mlp.linear_fc1")
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


@dataclass
class LoRAConfig:
    rank: int = 0  # 0: no LoRA
    alpha: float = 16.0
    dropout: float = 0.0
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    # megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2), HF names (q_proj, ...,
    # down_proj; the fused ones all together), `all-linear`, or globs over the global module
    # name, e.g. "decoder.layers.1*.mlp.*"
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def validate(self) -> None:
        if self.rank < 0:
            raise UserError(f"lora.rank={self.rank} must be positive (0 turns LoRA off)")
        if not self.enabled:
            return
        if self.alpha <= 0:
            raise UserError(f"lora.alpha={self.alpha} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise UserError("lora.target_modules is empty; e.g. [all-linear] or [linear_qkv, linear_proj]")
        self._patterns()  # raises on unknown or split-fused names

    def _patterns(self) -> list[str]:
        """Each target as a glob over the global module name."""
        hf_to_lf = {h: lf for lf, hs in LINEARS.items() for h in hs}
        wanted_hf: dict[str, set] = {}
        out = []
        for t in self.target_modules:
            if t == "all-linear":
                out += [f"*.{_short(lf)}" for lf in LINEARS]
            elif t in hf_to_lf:
                wanted_hf.setdefault(hf_to_lf[t], set()).add(t)
            elif any(_short(lf) == t or lf == t for lf in LINEARS):
                out.append(f"*.{_short(t)}")
            elif any(c in t for c in "*?["):
                out.append(t)
            else:
                names = sorted({lf.split(".")[-1] for lf in LINEARS} | set(hf_to_lf))
                raise UserError(f"lora.target_modules: unknown module {t!r}; use all-linear, one of {', '.join(names)}, or a glob")
        for lf, got in wanted_hf.items():
            fused = LINEARS[lf]
            if set(fused) != got:
                raise UserError(
                    f"lora.target_modules: {', '.join(sorted(got))} share one fused linear ({lf.split('.')[-1]}) with "
                    f"{', '.join(h for h in fused if h not in got)}; list all of {', '.join(fused)} or {lf.split('.')[-1]}"
                )
            out.append(f"*.{_short(lf)}")
        return out

    def targets(self, global_name: str) -> bool:
        return self.enabled and any(fnmatch.fnmatchcase(global_name, p) for p in self._patterns())


def _short(linear: str) -> str:
    """A decoder linear's own name (`linear_qkv`): megatron's layers hold it under
    `self_attention.` / `mlp.`, torch-native Gemma layers directly."""
    return linear.rsplit(".", 1)[-1]


def lora_from_manifest(manifest: dict) -> LoRAConfig | None:
    """A checkpoint's LoRA config (its manifest's `lora` section); None for a run without adapters."""
    lora = LoRAConfig(**manifest["config"].get("lora", {}))
    return lora if lora.enabled else None


def is_adapter_key(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def _name_seed(name: str) -> int:
    """The seed of `name`'s adapter: the last seed given to torch (not its generator's state)."""
    return (torch.initial_seed() * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _init_adapters(module, lora: LoRAConfig, name: str, in_features: int, out_features: int, split_dim: str):
    """Full-size A, then this rank's shard of it (row-parallel) or the whole (column-parallel)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    tp, rank = module.tp_group.size(), module.tp_group.rank()
    g = torch.Generator().manual_seed(_name_seed(name))
    bound = 1.0 / math.sqrt(in_features)
    a = torch.empty(lora.rank, in_features).uniform_(-bound, bound, generator=g)
    dtype = module.config.params_dtype
    if split_dim == "in":
        a = a.chunk(tp, dim=1)[rank]
        b = torch.zeros(out_features, lora.rank)
    else:
        b = torch.zeros(out_features // tp, lora.rank)
    module.lora_a = torch.nn.Parameter(a.to(dtype).contiguous())
    module.lora_b = torch.nn.Parameter(b.to(dtype))
    set_tensor_model_parallel_attributes(module.lora_a, split_dim == "in", 1, 1)
    set_tensor_model_parallel_attributes(module.lora_b, split_dim == "out", 0, 1)
    module.lora_scale = lora.scale
    module.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
    module.lora_name = name


@functools.cache
def lora_linear_classes():
    """(LoRAColumnParallelLinear, LoRARowParallelLinear); a factory, so importing this module
    does not import megatron-core."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class _Adapters:
        """What both LoRA linears share: the merged weight and a checkpoint layout that shards
        each adapter along the same TP axis as the part of the weight it updates."""

        lora_axes: dict

        def merged_weight(self) -> torch.Tensor:
            return self.weight + self.lora_scale * (self.lora_b @ self.lora_a)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            sd = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(
                sd, prefix, self.lora_axes, sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]
            )

    class LoRAColumnParallelLinear(_Adapters, ColumnParallelLinear):
        lora_axes = {"weight": 0, "bias": 0, "lora_b": 0}

        def __init__(self, input_size, output_size, *, lora: LoRAConfig, lora_name: str, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            if self.gather_output:
                raise ValueError("LoRA column-parallel linears do not gather their output")
            _init_adapters(self, lora, lora_name, input_size, output_size, "out")
            if self.sequence_parallel:  # A projects this rank's share of the sequence: its gradient sums over TP
                self.lora_a.sequence_parallel = True

        def forward(self, input_, weight=None, runtime_gather_output=None):
            out, bias = super().forward(input_, weight, runtime_gather_output)
            h = F.linear(self.lora_dropout(input_), self.lora_a)
            if self.sequence_parallel:  # (the base linear gathered the sequence; so does the rank-r projection)
                h = gather_from_sequence_parallel_region(h, group=self.tp_group)
            else:
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            return out + F.linear(h, self.lora_b) * self.lora_scale, bias

    class LoRARowParallelLinear(_Adapters, RowParallelLinear):
        lora_axes = {"weight": 1, "lora_a": 1}

        def __init__(self, input_size, output_size, *, lora: LoRAConfig, lora_name: str, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            if not self.input_is_parallel:
                raise ValueError("LoRA row-parallel linears take an already split input")
            _init_adapters(self, lora, lora_name, input_size, output_size, "in")
            if self.sequence_parallel:  # B projects this rank's share of the sequence: its gradient sums over TP
                self.lora_b.sequence_parallel = True

        def forward(self, input_):
            out, bias = super().forward(input_)
            h = F.linear(self.lora_dropout(input_), self.lora_a)
            if self.sequence_parallel:  # (the base linear reduce-scattered to the sequence share; so does the rank-r one)
                h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
            else:
                h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            return out + F.linear(h, self.lora_b) * self.lora_scale, bias

    return LoRAColumnParallelLinear, LoRARowParallelLinear


def linear_spec(lora: LoRAConfig | None, global_name: str, base_class):
    """The spec entry for one decoder linear: megatron's class, or its LoRA subclass when the
    config targets `global_name` (e.g. decoder.layers.3.self_attention.linear_qkv)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if lora is None or not lora.targets(global_name):
        return base_class
    column, row = lora_linear_classes()
    cls = column if global_name.endswith(COLUMN_PARALLEL) else row
    return ModuleSpec(module=cls, params={"lora": lora, "lora_name": global_name})


def freeze_base(model: torch.nn.Module) -> int:
    """Train only the adapters; return how many adapter parameters there are."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise UserError("lora.target_modules matched no linear of the model")
    # Full recompute replays each layer from its input; that input must need a gradient for the
    # adapters inside to get one, and a frozen embedding's output does not.
    emb = getattr(model, "embedding", None)
    if emb is not None:
        emb.register_forward_hook(lambda m, args, out: out.requires_grad_(True) if not out.requires_grad else out)
    return n


def merged_state(model: torch.nn.Module) -> dict:
    """The model's tensors with every adapter folded into its base weight (adapter keys gone)."""
    scales = {n: m.lora_scale for n, m in model.named_modules() if hasattr(m, "merged_weight")}
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return merge_adapters(state, scales)


def merge_adapters(state: dict, scale) -> dict:
    """A state dict with each `<linear>.lora_a` / `.lora_b` pair folded into `<linear>.weight`
    (W + scale * B A, in the weight's dtype; a TP shard's pair gives that shard's update) and gone.
    `scale`: one for every linear, or {linear name: scale}."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for k in state:
        if k.endswith(".lora_a"):
            name = k[: -len(".lora_a")]
            s = scale[name] if isinstance(scale, dict) else scale
            w = out[name + ".weight"]
            out[name + ".weight"] = (w.float() + s * (state[name + ".lora_b"].float() @ state[k].float())).to(w.dtype).detach()
    return out


class LoRALinear(torch.nn.Linear):
    """An `nn.Linear` plus adapters, output `W x + b + scale * B (A dropout(x))`; built from the
    linear it replaces, sharing its weight and bias."""

    def __init__(self, base: torch.nn.Linear, lora: LoRAConfig, name: str):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        g = torch.Generator().manual_seed(_name_seed(name))
        bound = 1.0 / math.sqrt(base.in_features)
        a = torch.empty(lora.rank, base.in_features).uniform_(-bound, bound, generator=g)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_a = torch.nn.Parameter(a.to(**like))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, lora.rank, **like))
        self.lora_scale = lora.scale
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b) * self.lora_scale

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.lora_scale * (self.lora_b @ self.lora_a)


def add_adapters(model: torch.nn.Module, lora: LoRAConfig, prefix: str = "") -> list[str]:
    """Replace every plain `nn.Linear` of `model` whose name (`prefix` + its name in `model`)
    `lora` targets with a `LoRALinear`; returns the names, in order (none: a UserError)."""
    names = []
    for name, module in list(model.named_modules()):
        full = prefix + name
        if type(module) is torch.nn.Linear and lora.targets(full):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, LoRALinear(module, lora, full))
            names.append(full)
    if not names:
        raise UserError(f"lora.target_modules={list(lora.target_modules)} matched no linear layer")
    return names
