"""The decoder families LoongForge ships. Llama, Qwen2 and Qwen3 share HF's tensor naming, so
one table serves all three; the specs differ in their defaults (qkv bias, q/k norm)."""

from __future__ import annotations

from loongforge.core.foundation.hf_mapping import Row
from loongforge.core.foundation.spec import FamilySpec

L = "decoder.layers.{i}."
H = "model.layers.{i}."

LLAMA_STYLE_TABLE = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
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
    Row(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "concat"),
    Row(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",)),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Row("output_layer.weight", ("lm_head.weight",), optional=True),
)

LLAMA = FamilySpec(
    "llama", "llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False, mapping=LLAMA_STYLE_TABLE, hf_extra_config=(("mlp_bias", False),)
)
QWEN2 = FamilySpec("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, mapping=LLAMA_STYLE_TABLE, hf_qkv_bias_key=None)
QWEN3 = FamilySpec("qwen3", "qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, mapping=LLAMA_STYLE_TABLE)

FAMILIES = (LLAMA, QWEN2, QWEN3)
