"""Decoder-only families as declarative specs, and the one builder that turns a spec plus a
model config into a megatron-core `GPTModel`."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
from loongforge.core.errors import UserError
from loongforge.core.ops import OpTable
from loongforge.core.ops.reference import rope_inv_freq


@dataclass
class ModelConfig:
    """Shape and options of a decoder backbone; field names follow megatron/HF usage."""

    family: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: same as num_attention_heads (MHA)
    ffn_hidden_size: int = 176
    vocab_size: int = 256
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF-style dict, e.g. {"rope_type": "llama3", ...}
    rotary_percent: float = 1.0
    # M-RoPE (Qwen2-VL / Qwen2.5-VL): rotary pairs per position row (time, height, width); the
    # model hands each token's angle tables to the layers (foundation.layers.rotary_tables)
    mrope_section: Optional[List[int]] = None
    # Qwen3-VL: the rows' pairs interleaved (time, height, width, time, ...) instead of in sections
    mrope_interleaved: bool = False
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: Optional[bool] = None  # None: the family's default
    qk_norm: Optional[bool] = None  # None: the family's default
    init_std: float = 0.02
    # multi-head latent attention (DeepSeek-V3; kv_lora_rank None: the family's grouped-query attention)
    kv_lora_rank: Optional[int] = None  # keys and values from a latent of this width (and a shared rotary key)
    q_lora_rank: Optional[int] = None  # queries through a latent of this width (None: one projection)
    qk_nope_head_dim: int = 128  # per-head query/key channels without rotary embedding
    qk_rope_head_dim: int = 64  # per-head query/key channels with rotary embedding
    v_head_dim: int = 128
    rope_interleave: bool = True  # rotary pairs are adjacent channels (DeepSeek's weight layout)
    # mixture of experts (num_experts = 0: every layer dense)
    num_experts: int = 0  # routed experts of each MoE layer
    moe_ffn_hidden_size: Optional[int] = None  # one expert's FFN width (None: ffn_hidden_size)
    moe_top_k: int = 2  # experts per token
    moe_norm_topk_prob: bool = True  # top-k probabilities renormalized to sum to 1 (false: the softmax over all experts)
    moe_layer_step: int = 1  # every moe_layer_step-th layer is MoE (HF decoder_sparse_step)
    moe_dense_layers: List[int] = field(default_factory=list)  # layers kept dense (HF mlp_only_layers)
    moe_aux_loss_type: str = (
        "aux_loss"  # aux_loss (over each micro-batch) | seq_aux_loss (per sequence) | global_aux_loss (over the step's global batch) | none
    )
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight
    moe_z_loss_coeff: float = 0.0  # router z-loss weight
    moe_capacity_factor: Optional[float] = None  # None: dropless; > 0: tokens over capacity * tokens/experts are dropped
    moe_score_function: Optional[str] = None  # softmax | sigmoid (None: the family's)
    moe_expert_bias: Optional[bool] = None  # a routing-only bias per expert, moved towards balance each step (None: the family's)
    moe_bias_update_rate: float = 1e-3  # how far the expert bias moves per optimizer step
    moe_groups: int = 1  # expert groups for group-limited routing (HF n_group; 1: off)
    moe_group_top_k: int = 1  # groups each token may route to (HF topk_group)
    moe_scaling_factor: float = 1.0  # routed experts' combined output times this (HF routed_scaling_factor)
    moe_shared_experts: int = 0  # always-active experts of moe_ffn_hidden_size each, run as one MLP (HF n_shared_experts)
    # multi-token prediction (DeepSeek-V3): modules after the decoder predicting 2, 3, ... tokens ahead
    mtp_num_layers: int = 0  # (HF num_nextn_predict_layers)
    mtp_loss_weight: float = 0.1  # training: their mean loss's weight beside the next-token loss

    def repeats(self) -> dict[str, int]:
        """Placeholder counts of the family's mapping rows (`{i}`: decoder layers, `{e}`: experts,
        `{m}`: multi-token prediction modules)."""
        return {"i": self.num_layers, "e": self.num_experts, "m": self.mtp_num_layers}

    def layer_kind(self, i: int) -> str:
        """'moe' or 'dense': what the MLP of decoder layer `i` (0-based) is."""
        moe = self.num_experts > 0 and i not in self.moe_dense_layers and (i + 1) % self.moe_layer_step == 0
        return "moe" if moe else "dense"

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def num_params(self) -> int:
        """Parameter count (embedding and output counted once if tied)."""
        return self._count(self.num_experts)

    def num_active_params(self) -> int:
        """Parameters one token computes with: the router and its top-k experts of each MoE layer."""
        return self._count(self.moe_top_k)

    def _count(self, experts_used: int) -> int:
        h, f, v, d = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.kv_channels
        nq, nkv = self.num_attention_heads, self.num_query_groups or self.num_attention_heads
        if self.kv_lora_rank:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * nq * qk if not self.q_lora_rank else h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nq * qk
            kv = (
                h * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.kv_lora_rank
                + self.kv_lora_rank * nq * (self.qk_nope_head_dim + self.v_head_dim)
            )
            attn = q + kv + nq * self.v_head_dim * h
        else:
            attn = h * d * (nq + 2 * nkv) + nq * d * h + (2 * d if self.qk_norm else 0) + ((nq + 2 * nkv) * d if self.qkv_bias else 0)
        total = self.mtp_num_layers * (2 * h * h + 3 * h)  # each MTP module's projection and norms (+ its layer, below)
        for i in range(self.num_layers + self.mtp_num_layers):
            if self.layer_kind(i) == "moe":
                mlp = self.num_experts * h + (experts_used + self.moe_shared_experts) * 3 * h * self.expert_ffn
            else:
                mlp = 3 * h * f
            total += attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return total + emb + h

    def attention_dims(self) -> tuple[int, int]:
        """Per-head (query/key, value) channels."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.kv_channels, self.kv_channels

    def flops_per_token(self, seq: int, frozen_weights: bool = False) -> float:
        """Training FLOPs per token, forward + backward, no recompute: 6 * active params (all of
        them for a dense model, embeddings included) + causal-agnostic attention 6 * layers *
        heads * (qk_head_dim + v_head_dim) * seq (12 * layers * heads * head_dim * seq where the
        two are equal). The convention of the benchmarks in docs/benchmarks.md.
        `frozen_weights` (LoRA): no weight gradients, 4 * params (adapters not counted)."""
        per_param = 4.0 if frozen_weights else 6.0
        qk, v = self.attention_dims()
        layers = self.num_layers + self.mtp_num_layers
        # (each MTP module uses the shared output layer once more)
        head_reuse = self.mtp_num_layers * self.vocab_size * self.hidden_size
        return per_param * (self.num_active_params() + head_reuse) + 6.0 * layers * self.num_attention_heads * (qk + v) * seq


# The model section's training options (the router's losses and bias steps, the MTP loss weight):
# a run takes them from its own config whatever its starting weights (an HF or LoongForge
# checkpoint gives the architecture, not how to train it).
MODEL_TRAINING_FIELDS = (
    "moe_aux_loss_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_capacity_factor",
    "moe_bias_update_rate",
    "mtp_loss_weight",
)


@dataclass(frozen=True)
class FamilySpec:
    """What makes a family: its HF identity, its default options and its name-mapping table."""

    name: str
    hf_model_type: str
    hf_architecture: str
    qkv_bias: bool
    qk_norm: bool
    mapping: tuple = field(default_factory=tuple)  # rows of foundation.hf_mapping.Row
    # the HF config key that switches the q/k/v bias (None: the family always has its default)
    hf_qkv_bias_key: Optional[str] = "attention_bias"
    hf_extra_config: tuple = ()  # (key, value) pairs the family's HF config.json carries besides the shape
    # (HF config key, ModelConfig field[, read, write]) rows the family reads and writes besides the
    # common shape (MoE and MLA options); an HF key may have older spellings ("key|older_key");
    # `read`/`write` convert where the two differ in form (HF first_k_dense_replace: a count)
    hf_fields: tuple = ()
    # None: HF config keys beyond those LoongForge reads are ignored (the dense families); a tuple:
    # the only other keys a config may hold (named in an error otherwise), each as "key" (any
    # value) or ("key", value) (a feature LoongForge does not implement unless it has this value)
    hf_other_keys: Optional[tuple] = None
    hf_model_type_aliases: tuple = ()  # other model_type values of configs this family reads (exports use hf_model_type)
    moe_score_function: str = "softmax"  # the router's score over experts
    moe_expert_bias: bool = False  # aux-loss-free balancing bias (needs sigmoid scores)

    def resolve(self, cfg: ModelConfig) -> ModelConfig:
        """Fill the options the config leaves to the family."""
        return dataclasses.replace(
            cfg,
            qkv_bias=self.qkv_bias if cfg.qkv_bias is None else cfg.qkv_bias,
            qk_norm=self.qk_norm if cfg.qk_norm is None else cfg.qk_norm,
            num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
            moe_score_function=cfg.moe_score_function or self.moe_score_function,
            moe_expert_bias=self.moe_expert_bias if cfg.moe_expert_bias is None else cfg.moe_expert_bias,
        )


def transformer_config(
    cfg: ModelConfig,
    tp: int,
    pp: int,
    params_dtype: torch.dtype,
    recompute: bool,
    ep: int = 1,
    sequence_parallel: bool = False,
    moe_token_dispatcher_type: str = "allgather",
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(cfg.qkv_bias),
        qk_layernorm=bool(cfg.qk_norm),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if cfg.num_experts:
        kw.update(
            num_moe_experts=cfg.num_experts,
            moe_ffn_hidden_size=cfg.expert_ffn,
            moe_router_topk=cfg.moe_top_k,
            # megatron's pre-softmax routing keeps the softmax-over-all probabilities of the top k;
            # without it, the softmax over the top-k logits: the renormalized top-k probabilities
            moe_router_pre_softmax=cfg.moe_score_function != "sigmoid" and not cfg.moe_norm_topk_prob,
            moe_router_score_function=cfg.moe_score_function or "softmax",
            moe_router_enable_expert_bias=bool(cfg.moe_expert_bias),
            moe_router_bias_update_rate=cfg.moe_bias_update_rate,
            moe_router_num_groups=cfg.moe_groups if cfg.moe_groups > 1 else None,
            moe_router_group_topk=cfg.moe_group_top_k if cfg.moe_groups > 1 else None,
            moe_router_topk_scaling_factor=cfg.moe_scaling_factor if cfg.moe_scaling_factor != 1.0 else None,
            moe_shared_expert_intermediate_size=cfg.moe_shared_experts * cfg.expert_ffn or None,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type=cfg.moe_aux_loss_type,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff if cfg.moe_aux_loss_type != "none" else 0.0,
            moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,
            moe_expert_capacity_factor=cfg.moe_capacity_factor,
            moe_token_dispatcher_type=moe_token_dispatcher_type,
            moe_layer_freq=[int(cfg.layer_kind(i) == "moe") for i in range(cfg.num_layers)],
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            # the trainer normalizes by the global loss weight: aux losses enter backward times
            # their micro-batch's token count (foundation/moe.py)
            calculate_per_token_loss=True,
        )
    return TransformerConfig(**kw)


def block_spec(cfg: ModelConfig, ops: OpTable, num_layers: int, ctx, lora=None, first_layer: int = 0):
    """megatron-core block spec for one pipeline stage of `num_layers` layers (global indices
    from `first_layer`) on the process groups of `ctx` (a ParallelContext); the layers are
    `layer_spec`'s, the final norm the op table's."""
    from loongforge.core.foundation.layers import RMSNorm
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    layer = layer_spec(cfg, ops, ctx, lora)
    norm = ModuleSpec(module=RMSNorm, params={"ops": ops})
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer(first_layer + j) for j in range(num_layers)], layer_norm=norm),
    )


def layer_spec(cfg: ModelConfig, ops: OpTable, ctx, lora=None):
    """`spec(i)`: the megatron-core spec of decoder layer `i` (global index; an MTP module's layer
    is numbered after the decoder's): megatron's parallel linears, attention block (grouped-query
    or latent) and MLP or MoE block; every norm, the rotary attention core, the SwiGLU activation
    and the experts compute through the op table. Linears that `lora` (a LoRAConfig) targets get
    their LoRA class."""
    from loongforge.core.foundation.layers import (
        RMSNorm,
        RotarySDPAttention,
        fused_qkv_attention_class,
        fused_residual_layer_class,
        swiglu_mlp_class,
    )
    from loongforge.core.foundation.lora import linear_spec
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    norm = ModuleSpec(module=RMSNorm, params={"ops": ops})
    qk_norm = ModuleSpec(module=RMSNorm, params={"ops": ops, "per_head": True}) if cfg.qk_norm else IdentityOp

    if cfg.kv_lora_rank:
        from loongforge.core.foundation.mla import MLADims, MLASubmodules, ReplicatedLinear, mla_attention_class, mla_rope

        mla_inv_freq, rotary_factor, softmax_scale = mla_rope(cfg)
        dims = MLADims(cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rope_interleave)

        def attention(linear):
            return ModuleSpec(
                module=mla_attention_class(),
                params={"ops": ops, "dims": dims, "inv_freq": mla_inv_freq, "rotary_factor": rotary_factor, "softmax_scale": softmax_scale},
                submodules=MLASubmodules(
                    linear_q_proj=linear("self_attention.linear_q_proj", ColumnParallelLinear),
                    linear_q_down_proj=ReplicatedLinear,
                    q_layernorm=norm,
                    linear_q_up_proj=linear("self_attention.linear_q_up_proj", ColumnParallelLinear),
                    linear_kv_down_proj=ReplicatedLinear,
                    kv_layernorm=norm,
                    linear_kv_up_proj=linear("self_attention.linear_kv_up_proj", ColumnParallelLinear),
                    linear_proj=linear("self_attention.linear_proj", RowParallelLinear),
                ),
            )
    else:
        inv_freq = rope_inv_freq(int(cfg.kv_channels * cfg.rotary_percent), cfg.rope_theta, cfg.rope_scaling)

        def attention(linear):
            return ModuleSpec(
                module=fused_qkv_attention_class(),
                params={"attn_mask_type": AttnMaskType.causal, "ops": ops},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear("self_attention.linear_qkv", ColumnParallelLinear),
                    core_attention=ModuleSpec(module=RotarySDPAttention, params={"ops": ops, "inv_freq": inv_freq}),
                    linear_proj=linear("self_attention.linear_proj", RowParallelLinear),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            )

    def dense_mlp(linear):
        return ModuleSpec(
            module=swiglu_mlp_class(),
            # megatron passes its TP group only to modules that are exactly its MLP class
            params={"ops": ops, "tp_group": ctx.tp_group},
            submodules=MLPSubmodules(
                linear_fc1=linear("mlp.linear_fc1", ColumnParallelLinear), linear_fc2=linear("mlp.linear_fc2", RowParallelLinear)
            ),
        )

    moe = None
    if cfg.num_experts:
        from loongforge.core.foundation.moe import ensure_router_without_te, grouped_experts_class, moe_layer_class, router_class
        from megatron.core.transformer.moe.moe_layer import MoESubmodules

        ensure_router_without_te()
        experts = ModuleSpec(module=grouped_experts_class(), params={"ops": ops})
        shared = None
        if cfg.moe_shared_experts:
            from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

            shared = ModuleSpec(
                module=SharedExpertMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            )
        # (megatron passes its groups only to modules that are exactly its MoELayer class)
        moe = ModuleSpec(
            module=moe_layer_class(),
            params={"ops": ops, "pg_collection": ctx.pg_collection()},
            submodules=MoESubmodules(experts=experts, router=router_class(), shared_experts=shared),
        )

    def layer(i: int):
        def linear(name, base):
            return linear_spec(lora, f"decoder.layers.{i}.{name}", base)

        return ModuleSpec(
            module=fused_residual_layer_class(),
            params={"ops": ops},
            submodules=TransformerLayerSubmodules(
                input_layernorm=norm,
                self_attention=attention(linear),
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=norm,
                mlp=moe if cfg.layer_kind(i) == "moe" else dense_mlp(linear),
                mlp_bda=get_bias_dropout_add,
            ),
        )

    return layer


@functools.cache
def gpt_model_class():
    """megatron-core's GPTModel, whose loss, given per-token weights as `loss_mask`, is the
    weighted sum of the tokens' cross-entropies. At TP=1 the output projection and the loss are
    one op-table call (`linear_cross_entropy`: fused implementations never hold the logits); a
    vocab-parallel output layer keeps megatron's own cross-entropy. With multi-token prediction
    (foundation.mtp, on the last stage) a pipeline's last stage holds a copy of the word
    embedding, as megatron-core's MTP does (with tied embeddings, the output layer's weight). A factory, so that importing this module does not
    import megatron-core."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.multi_token_prediction import tie_word_embeddings_state_dict
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    class LossWeightedGPTModel(GPTModel):
        def __init__(self, *args, ops: OpTable | None = None, multi_token_prediction=None, mtp_num_layers: int = 0, **kwargs):
            super().__init__(*args, **kwargs)
            self.ops = ops or OpTable()
            self.multi_token_prediction = multi_token_prediction  # foundation.mtp's modules (training loss only)
            if mtp_num_layers and self.pp_group.size() > 1:
                self._share_embedding_with_mtp()

        def setup_embeddings_and_output_layer(self) -> None:
            """megatron's, but the all-reduce that starts a tied last-stage copy equal to the
            first stage's embedding runs on the accelerator's device (megatron's moves the weight
            to CUDA, which a CPU run has not)."""
            group, self.embd_group = self.embd_group, None  # (megatron skips the all-reduce without a group)
            try:
                super().setup_embeddings_and_output_layer()
            finally:
                self.embd_group = group
            if self.share_embeddings_and_output_weights and self.pp_group.size() > 1 and (self.pre_process or self.post_process):
                self._copy_first_stage_embedding(self.shared_embedding_or_output_weight())

        def _copy_first_stage_embedding(self, weight) -> None:
            """The first stage's word embedding into the last stage's zeroed copy of it (both
            stages call this: a sum over the embedding group)."""
            import torch.distributed as dist
            from loongforge.core.accelerator import active_accelerator

            acc = active_accelerator()
            buf = weight.data.to(acc.device() if acc is not None else weight.device)  # (NCCL reduces device tensors only)
            dist.all_reduce(buf, group=self.embd_group)
            weight.data.copy_(buf)

        def _share_embedding_with_mtp(self) -> None:
            """The MTP modules embed on the last stage: it gets a copy of the first stage's word
            embedding, started equal to it and kept equal by the embedding group's gradient
            all-reduce (the `shared_embedding` mark; `shared`: counted once in the norm). With
            tied embeddings the output weight is that copy already: it moves into the embedding,
            one tensor serving both uses (megatron-core's layout at its MTP stage), so the one
            all-reduce sums the gradients of every use."""
            if self.post_process and not self.pre_process:
                with torch.random.fork_rng(devices=[]):  # its init draws leave the run's RNG as it was
                    self.embedding = LanguageModelEmbedding(
                        config=self.config,
                        vocab_size=self.vocab_size,
                        max_sequence_length=self.max_sequence_length,
                        position_embedding_type="none",
                        tp_group=self.pg_collection.tp,
                    )
                if self.share_embeddings_and_output_weights:  # (zeroed, marked and started equal by the setup)
                    self.embedding.word_embeddings.weight = self.output_layer.weight
                    self.output_layer.weight = None
                    return
                weight = self.embedding.word_embeddings.weight
                weight.shared = True
                weight.data.zero_()
            elif self.pre_process and not self.share_embeddings_and_output_weights:
                weight = self.embedding.word_embeddings.weight
            else:
                return
            weight.shared_embedding = True
            self._copy_first_stage_embedding(weight)

        def _embedding_is_output_weight(self) -> bool:
            """A last stage of MTP with tied embeddings: its embedding copy is the output weight."""
            return self.post_process and not self.pre_process and self.output_layer.weight is None

        def shared_embedding_or_output_weight(self):
            if self._embedding_is_output_weight():
                return self.embedding.word_embeddings.weight
            return super().shared_embedding_or_output_weight()

        def tie_embeddings_and_output_weights_state_dict(
            self, sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key, metadata=None
        ):
            if self._embedding_is_output_weight():
                return  # no output weight to tie: the embedding copy (a replica, in sharded_state_dict below) serves as it
            super().tie_embeddings_and_output_weights_state_dict(
                sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key, metadata
            )

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            if self.multi_token_prediction is not None and not self.pre_process:  # the copy: a replica of the first stage's
                tie_word_embeddings_state_dict(
                    sd,
                    self.embedding.word_embeddings.weight,
                    f"{prefix}embedding.word_embeddings.weight",
                    tp_group=self.pg_collection.tp,
                    dp_cp_group=metadata["dp_cp_group"],
                )
            return sd

        def _weighted_loss(self, hidden_states, labels, weights, output_weight=None):
            """The sum over tokens of weights * cross-entropy of hidden states [s, b, h] against
            labels [b, s] with weights [b, s], through the output layer (`output_weight`: the tied
            embedding)."""
            if self.output_layer.tp_group.size() == 1:
                weight = self.output_layer.weight if output_weight is None else output_weight
                return self.ops.linear_cross_entropy(
                    hidden_states.reshape(-1, hidden_states.shape[-1]), weight, labels.t().reshape(-1), weights.t().reshape(-1).float()
                )
            logits, _ = self.output_layer(hidden_states, weight=output_weight)  # vocab-parallel
            return (self.compute_language_model_loss(labels, logits).float() * weights).sum()

        def _postprocess(self, hidden_states, **kw):
            labels, weights = kw.get("labels"), kw.get("loss_mask")
            if not self.post_process or labels is None or weights is None or self.mtp_process:
                return super()._postprocess(hidden_states, **kw)
            output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            loss_fn = functools.partial(self._weighted_loss, output_weight=output_weight)
            loss = loss_fn(hidden_states, labels, weights)
            if self.multi_token_prediction is not None:
                from loongforge.core.foundation.moe import attach_loss

                mtp = self.multi_token_prediction(
                    hidden_states, kw["input_ids"], labels, weights, self.embedding, loss_fn, kw.get("packed_seq_params")
                )
                loss = attach_loss(loss, mtp)  # in backward, not in the reported next-token loss
            return loss

    return LossWeightedGPTModel


AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def validate_moe(cfg: ModelConfig, ep: int = 1, tp: int = 1, sequence_parallel: bool = False) -> None:
    """The MoE options against each other and the layout: one UserError naming the key."""
    if not cfg.num_experts:
        if ep > 1:
            raise UserError(f"parallel.expert_model_parallel_size={ep} needs a MoE model (model.num_experts > 0); set it to 1")
        return
    if cfg.num_experts < 0:
        raise UserError(f"model.num_experts={cfg.num_experts} must be at least 0 (0: a dense model)")
    if not 1 <= cfg.moe_top_k <= cfg.num_experts:
        raise UserError(f"model.moe_top_k={cfg.moe_top_k} must be between 1 and model.num_experts={cfg.num_experts}")
    if cfg.num_experts % ep:
        raise UserError(
            f"parallel.expert_model_parallel_size={ep} does not divide model.num_experts={cfg.num_experts}; choose a divisor of {cfg.num_experts}"
        )
    if tp > 1 and not sequence_parallel:
        raise UserError(
            f"parallel.tensor_model_parallel_size={tp}: a MoE model at tensor_model_parallel_size > 1 needs "
            "parallel.sequence_parallel=true (megatron-core's MoE layer routes each TP rank's share of the sequence)"
        )
    if cfg.moe_layer_step < 1:
        raise UserError(f"model.moe_layer_step={cfg.moe_layer_step} must be at least 1")
    bad = [i for i in cfg.moe_dense_layers if not 0 <= i < cfg.num_layers]
    if bad:
        raise UserError(f"model.moe_dense_layers: layer {bad[0]} does not exist (layers are 0..{cfg.num_layers - 1})")
    if cfg.moe_aux_loss_type not in AUX_LOSS_TYPES:
        raise UserError(f"model.moe_aux_loss_type={cfg.moe_aux_loss_type!r}: choose one of {', '.join(AUX_LOSS_TYPES)}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if not getattr(cfg, name) >= 0:
            raise UserError(f"model.{name}={getattr(cfg, name)} must be at least 0")
    if cfg.moe_capacity_factor is not None and not cfg.moe_capacity_factor > 0:
        raise UserError(f"model.moe_capacity_factor={cfg.moe_capacity_factor} must be > 0 (or null: dropless)")
    if cfg.moe_score_function not in ("softmax", "sigmoid"):
        raise UserError(f"model.moe_score_function={cfg.moe_score_function!r}: choose softmax or sigmoid")
    if cfg.moe_expert_bias and cfg.moe_score_function != "sigmoid":
        raise UserError(
            "model.moe_expert_bias=true needs model.moe_score_function=sigmoid (the aux-loss-free bias is added to sigmoid scores)"
        )
    if cfg.moe_score_function == "sigmoid" and cfg.moe_top_k > 1 and not cfg.moe_norm_topk_prob:
        raise UserError(
            "model.moe_norm_topk_prob=false with sigmoid scores is not implemented (the top-k sigmoid scores are always renormalized)"
        )
    if cfg.moe_groups > 1:
        g, k = cfg.moe_groups, cfg.moe_group_top_k
        if cfg.num_experts % g or not 1 <= k <= g:
            raise UserError(
                f"model.moe_groups={g}, moe_group_top_k={k}: the groups must divide model.num_experts={cfg.num_experts} and 1 <= moe_group_top_k <= moe_groups"
            )
        if cfg.moe_top_k != 2 * k:
            raise UserError(
                f"model.moe_top_k={cfg.moe_top_k} with moe_group_top_k={k}: group-limited routing ranks each group by its top 2 "
                f"scores (DeepSeek-V3), which needs moe_top_k = 2 * moe_group_top_k"
            )
    if cfg.moe_shared_experts < 0:
        raise UserError(f"model.moe_shared_experts={cfg.moe_shared_experts} must be at least 0")


def build_gpt_model(
    cfg: ModelConfig,
    ctx,
    ops: OpTable | None = None,
    params_dtype=torch.float32,
    recompute: bool = False,
    lora=None,
    moe_token_dispatcher_type: str = "allgather",
):
    """Build this rank's pipeline stage of the model on the CPU (megatron's CPU init makes the
    weights independent of the TP layout); the caller moves it to the device. With `lora` (an
    enabled LoRAConfig) the targeted linears carry adapters and everything else is frozen.
    `moe_token_dispatcher_type`: `parallel.moe_token_dispatcher_type` (allgather | alltoall)."""
    if cfg.num_layers % ctx.pp_size:
        raise UserError(f"model.num_layers={cfg.num_layers} must be divisible by pipeline_model_parallel_size={ctx.pp_size}")
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("num_query_groups", cfg.num_query_groups)):
        if n % ctx.tp_size:
            raise UserError(f"model.{name}={n} must be divisible by tensor_model_parallel_size={ctx.tp_size}")
    validate_moe(cfg, ctx.ep_size, ctx.tp_size, ctx.sequence_parallel)
    ops = ops or OpTable()
    per_stage = cfg.num_layers // ctx.pp_size
    config = transformer_config(
        cfg, ctx.tp_size, ctx.pp_size, params_dtype, recompute, ctx.ep_size, ctx.sequence_parallel, moe_token_dispatcher_type
    )
    mtp = None
    if cfg.mtp_num_layers and ctx.is_last_stage:  # (megatron-core's placement)
        from loongforge.core.foundation.mtp import mtp_class

        mtp = mtp_class()(config, cfg, layer_spec(cfg, ops, ctx, lora), ctx.pg_collection(), ops)
    model = gpt_model_class()(
        config=config,
        multi_token_prediction=mtp,
        mtp_num_layers=cfg.mtp_num_layers,
        transformer_layer_spec=block_spec(cfg, ops, per_stage, ctx, lora, ctx.pp_rank * per_stage),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="none",
        pg_collection=ctx.pg_collection(),
        ops=ops,
    )
    if lora is not None and lora.enabled:
        from loongforge.core.foundation.lora import freeze_base

        freeze_base(model)
    return model
