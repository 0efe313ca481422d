"""The decoder families LoongForge ships. Llama, Qwen2, Qwen3 and Qwen3-MoE share HF's tensor
naming, so one set of rows serves all; the specs differ in their defaults (qkv bias, q/k norm)
and Qwen3-MoE adds its router and experts (HF keeps one tensor per expert, LoongForge one tensor
of all a layer's experts: the `{e}` rows stack them)."""

from __future__ import annotations

import dataclasses

from loongforge.core.foundation.hf_mapping import Row
from loongforge.core.foundation.spec import FamilySpec

L = "decoder.layers.{i}."
H = "model.layers.{i}."

# each layer's attention and norms
ATTENTION_ROWS = (
    Row(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
    Row(
        L + "self_attention.linear_qkv.weight",
        (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"),
        "qkv",
    ),
    Row(
        L + "self_attention.linear_qkv.bias",
        (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias"),
        "qkv",
        optional=True,
    ),
    Row(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",), optional=True),
    Row(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",), optional=True),
    Row(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",)),
    Row(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
)
DENSE_MLP_ROWS = (
    Row(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "concat"),
    Row(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",)),
)
MOE_ROWS = (
    Row(L + "mlp.router.weight", (H + "mlp.gate.weight",)),
    Row(L + "mlp.experts.fc1", (H + "mlp.experts.{e}.gate_proj.weight", H + "mlp.experts.{e}.up_proj.weight"), "concat"),
    Row(L + "mlp.experts.fc2", (H + "mlp.experts.{e}.down_proj.weight",)),
)
EMBEDDING_ROW = Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))
OUTPUT_ROWS = (
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Row("output_layer.weight", ("lm_head.weight",), optional=True),
)

LLAMA_STYLE_TABLE = (EMBEDDING_ROW, *ATTENTION_ROWS, *DENSE_MLP_ROWS, *OUTPUT_ROWS)
# each layer holds either a dense MLP or a router and experts (decoder_sparse_step, mlp_only_layers)
QWEN_MOE_TABLE = (EMBEDDING_ROW, *ATTENTION_ROWS, *(dataclasses.replace(r, optional=True) for r in DENSE_MLP_ROWS + MOE_ROWS), *OUTPUT_ROWS)

LLAMA = FamilySpec(
    "llama", "llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False, mapping=LLAMA_STYLE_TABLE, hf_extra_config=(("mlp_bias", False),)
)
QWEN2 = FamilySpec(
    "qwen2",
    "qwen2",
    "Qwen2ForCausalLM",
    qkv_bias=True,
    qk_norm=False,
    mapping=LLAMA_STYLE_TABLE,
    hf_qkv_bias_key=None,
    hf_model_type_aliases=("qwen2_5_vl_text",),  # Qwen2.5-VL's language model (its text_config): Qwen2 with M-RoPE
)
QWEN3 = FamilySpec(
    "qwen3",
    "qwen3",
    "Qwen3ForCausalLM",
    qkv_bias=False,
    qk_norm=True,
    mapping=LLAMA_STYLE_TABLE,
    hf_model_type_aliases=("qwen3_vl_text",),  # Qwen3-VL's language model: Qwen3 with interleaved M-RoPE
)

# HF config keys every strict family accepts without reading them: metadata and inference options
HF_METADATA_KEYS = (
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "output_router_logits",
    "auto_map",  # remote-code class names (Kimi-K2's config points at its copy of DeepSeek-V3's code)
    ("hidden_act", "silu"),
    ("attention_dropout", 0.0),
)

QWEN3_MOE = FamilySpec(
    "qwen3_moe",
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    qkv_bias=False,
    qk_norm=True,
    mapping=QWEN_MOE_TABLE,
    hf_fields=(
        ("num_experts|num_local_experts", "num_experts"),
        ("num_experts_per_tok", "moe_top_k"),
        ("moe_intermediate_size", "moe_ffn_hidden_size"),
        ("norm_topk_prob", "moe_norm_topk_prob"),
        ("decoder_sparse_step", "moe_layer_step"),
        ("mlp_only_layers", "moe_dense_layers"),
    ),
    # router_aux_loss_coef: a training option (model.moe_aux_loss_coeff of the run config)
    hf_other_keys=(
        *HF_METADATA_KEYS,
        "router_aux_loss_coef",
        ("use_sliding_window", False),
        "sliding_window",
        "max_window_layers",
        "layer_types",
    ),
)

MLA_ROWS = (
    Row(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
    Row(L + "self_attention.linear_q_proj.weight", (H + "self_attn.q_proj.weight",), optional=True),  # without a query latent
    Row(L + "self_attention.linear_q_down_proj.weight", (H + "self_attn.q_a_proj.weight",), optional=True),
    Row(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_a_layernorm.weight",), optional=True),
    Row(L + "self_attention.linear_q_up_proj.weight", (H + "self_attn.q_b_proj.weight",), optional=True),
    Row(L + "self_attention.linear_kv_down_proj.weight", (H + "self_attn.kv_a_proj_with_mqa.weight",)),
    Row(L + "self_attention.kv_layernorm.weight", (H + "self_attn.kv_a_layernorm.weight",)),
    Row(L + "self_attention.linear_kv_up_proj.weight", (H + "self_attn.kv_b_proj.weight",)),
    Row(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",)),
    Row(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
)
DEEPSEEK_MOE_ROWS = (
    *MOE_ROWS,
    Row(L + "mlp.router.expert_bias", (H + "mlp.gate.e_score_correction_bias",)),
    Row(
        L + "mlp.shared_experts.linear_fc1.weight",
        (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"),
        "concat",
    ),
    Row(L + "mlp.shared_experts.linear_fc2.weight", (H + "mlp.shared_experts.down_proj.weight",)),
)
DEEPSEEK_LAYER_ROWS = (*MLA_ROWS, *(dataclasses.replace(r, optional=True) for r in DENSE_MLP_ROWS + DEEPSEEK_MOE_ROWS))

# multi-token prediction module m: HF layer num_layers + m (its decoder layer's tensors beside
# enorm / hnorm / eh_proj / shared_head, and copies of the embedding and output head)
M, HM = "multi_token_prediction.layers.{m}.", "model.layers.{m}."
MTP_SHIFT = (("m", "num_layers"),)


def mtp_rows(layer_rows: tuple) -> tuple:
    """The rows of the MTP modules of a family whose decoder layers map by `layer_rows`."""
    return (
        *(
            Row(r.lf.replace(L, M + "layer."), tuple(h.replace(H, HM) for h in r.hf), r.transform, r.optional, MTP_SHIFT)
            for r in layer_rows
        ),
        Row(M + "enorm.weight", (HM + "enorm.weight",), hf_shift=MTP_SHIFT),
        Row(M + "hnorm.weight", (HM + "hnorm.weight",), hf_shift=MTP_SHIFT),
        Row(M + "eh_proj.weight", (HM + "eh_proj.weight",), hf_shift=MTP_SHIFT),
        Row(M + "final_layernorm.weight", (HM + "shared_head.norm.weight",), hf_shift=MTP_SHIFT),
        Row("embedding.word_embeddings.weight", (HM + "embed_tokens.weight",), "copies", hf_shift=MTP_SHIFT),
        Row("output_layer.weight", (HM + "shared_head.head.weight",), "copies", hf_shift=MTP_SHIFT, tied=EMBEDDING_ROW.lf),
    )


DEEPSEEK_TABLE = (EMBEDDING_ROW, *DEEPSEEK_LAYER_ROWS, *OUTPUT_ROWS, *mtp_rows(DEEPSEEK_LAYER_ROWS))


def _first_layers(layers: list) -> int:
    """HF's first_k_dense_replace from a list of dense layers, which must be the first ones."""
    if list(layers) != list(range(len(layers))):
        raise ValueError(f"DeepSeek-V3 configs keep the first layers dense: model.moe_dense_layers={layers} is not 0..k-1")
    return len(layers)


# the MoE and MTP keys of DeepSeek-V3-style HF configs (DeepSeek-V3, GLM-4.5)
DEEPSEEK_MOE_FIELDS = (
    ("n_routed_experts|num_local_experts", "num_experts"),
    ("num_experts_per_tok", "moe_top_k"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("norm_topk_prob", "moe_norm_topk_prob"),
    ("first_k_dense_replace", "moe_dense_layers", lambda k: list(range(k)), _first_layers),
    ("n_group", "moe_groups"),
    ("topk_group", "moe_group_top_k"),
    ("routed_scaling_factor", "moe_scaling_factor"),
    ("n_shared_experts", "moe_shared_experts"),
    ("num_nextn_predict_layers|num_mtp_layers", "mtp_num_layers"),
)

DEEPSEEK_V3 = FamilySpec(
    "deepseek_v3",
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    qkv_bias=False,
    qk_norm=False,
    mapping=DEEPSEEK_TABLE,
    hf_qkv_bias_key=None,
    hf_fields=(
        *DEEPSEEK_MOE_FIELDS,
        ("q_lora_rank", "q_lora_rank"),
        ("kv_lora_rank", "kv_lora_rank"),
        ("qk_nope_head_dim", "qk_nope_head_dim"),
        ("qk_rope_head_dim", "qk_rope_head_dim"),
        ("v_head_dim", "v_head_dim"),
        ("rope_interleave", "rope_interleave"),
    ),
    hf_other_keys=(
        *HF_METADATA_KEYS,
        ("attention_bias", False),
        ("pretraining_tp", 1),
        "qk_head_dim",  # derived: qk_nope_head_dim + qk_rope_head_dim
        ("scoring_func", "sigmoid"),  # older (remote-code) DeepSeek-V3 configs
        ("topk_method", "noaux_tc"),
        ("moe_layer_freq", 1),
        "aux_loss_alpha",
        "seq_aux",
        "ep_size",
    ),
    moe_score_function="sigmoid",
    moe_expert_bias=True,
    hf_model_type_aliases=("kimi_k2",),  # Kimi-K2: DeepSeek-V3's architecture with other numbers
)

# GLM-4.5: grouped-query attention (q/k/v bias, half the head dims rotated, optional q/k norm)
# under DeepSeek-V3's MoE (sigmoid routing with the expert bias, shared experts, first dense
# layers) and multi-token prediction
GLM_LAYER_ROWS = (*ATTENTION_ROWS, *(dataclasses.replace(r, optional=True) for r in DENSE_MLP_ROWS + DEEPSEEK_MOE_ROWS))
GLM4_MOE = FamilySpec(
    "glm4_moe",
    "glm4_moe",
    "Glm4MoeForCausalLM",
    qkv_bias=False,
    qk_norm=False,
    mapping=(EMBEDDING_ROW, *GLM_LAYER_ROWS, *OUTPUT_ROWS, *mtp_rows(GLM_LAYER_ROWS)),
    hf_fields=(
        *DEEPSEEK_MOE_FIELDS,
        ("use_qk_norm", "qk_norm"),
    ),
    hf_other_keys=(*HF_METADATA_KEYS, ("pretraining_tp", 1)),
    moe_score_function="sigmoid",
    moe_expert_bias=True,
)

FAMILIES = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, DEEPSEEK_V3, GLM4_MOE)
