"""Multi-token prediction (DeepSeek-V3): D extra modules after the decoder, module k predicting the
token k + 1 places further on, each keeping the causal chain.

Module k takes the previous depth's hidden states h (the decoder's output after its final norm
for k = 1, as megatron-core takes them) and the shared embedding of the input shifted k places,
projects `[enorm(embedding); hnorm(h)]` to the hidden size (`eh_proj`), runs one decoder layer
(of the decoder's own kind: latent attention and a MoE MLP for DeepSeek-V3), normalizes
(`final_layernorm`, HF's `shared_head.norm`) and predicts through the shared output layer. Its
loss is the cross-entropy against the labels shifted k places, weighted like the main loss's
tokens shifted likewise (positions whose target lies past the end of the row, or of the packed
sample, weigh 0). The trainer optimizes main + mtp_loss_weight / D * sum over depths, each a
sum over tokens like the main loss (so normalized by the same global weight).

Layouts (as megatron-core places its own MTP block): the modules live on the last pipeline
stage, which holds a copy of the first stage's word embedding for their input (kept equal
through the embedding group, like tied embeddings; built by spec's GPT model). With tied
embeddings that one copy is the output layer's weight too, so its gradient sums every use.
Every piece is tensor-parallel the way the decoder is: the layer is a decoder layer, `eh_proj`
and the norms are replicated, and the loss is the model's own (the fused linear + cross-entropy
at TP=1, the vocab-parallel output layer and cross-entropy at TP > 1).

HF's DeepseekV3ForCausalLM has no MTP modules (it skips their weights); LoongForge reads and
writes them in the DeepSeek-V3 checkpoint layout: `model.layers.{num_layers + k - 1}.*`.
"""

from __future__ import annotations

import functools

import torch
from loongforge.core.ops import OpTable


def _shift(t: torch.Tensor, fill) -> torch.Tensor:
    """[batch, seq] -> each position takes the next one's value; the last takes `fill`."""
    return torch.cat([t[:, 1:], t.new_full((t.shape[0], 1), fill)], dim=1)


@functools.cache
def mtp_class():
    """A factory, so that importing this module does not import megatron-core."""
    from loongforge.core.foundation.layers import RMSNorm
    from loongforge.core.foundation.mla import ReplicatedLinear
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    class MTPDepth(MegatronModule):
        def __init__(self, config, layer_spec, layer_number: int, pg_collection, ops: OpTable):
            super().__init__(config=config)
            h, eps = config.hidden_size, config.layernorm_epsilon
            self.enorm = RMSNorm(config, h, eps, ops)
            self.hnorm = RMSNorm(config, h, eps, ops)
            self.eh_proj = ReplicatedLinear(2 * h, h, config=config, init_method=config.init_method)
            # megatron's layer adds its stage's layer offset to the number it is given; the module
            # keeps its global number (num_layers + k) on the last stage of any pipeline
            offset = get_transformer_layer_offset(config, None, get_pg_rank(pg_collection.pp))
            self.layer = build_module(layer_spec, config=config, layer_number=layer_number - offset, pg_collection=pg_collection)
            self.final_layernorm = RMSNorm(config, h, eps, ops)

    class MultiTokenPrediction(MegatronModule):
        def __init__(self, config, cfg, layer_spec, pg_collection, ops: OpTable):
            super().__init__(config=config)
            self.ops = ops
            self.loss_weight = cfg.mtp_loss_weight
            self.layers = torch.nn.ModuleList(
                MTPDepth(config, layer_spec(cfg.num_layers + k), cfg.num_layers + k + 1, pg_collection, ops)
                for k in range(cfg.mtp_num_layers)
            )
            self.losses: list[torch.Tensor] = []  # each depth's weighted loss sum of the last forward (detached)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
            """Each depth's own (megatron's default would take the plain ModuleList's tensors as
            replicated, losing the layer's tensor-parallel split)."""
            out = {}
            for k, depth in enumerate(self.layers):
                out.update(depth.sharded_state_dict(f"{prefix}layers.{k}.", sharded_offsets, metadata))
            return out

        def forward(self, hidden, input_ids, labels, weights, embedding, loss_fn, packed_seq_params=None) -> torch.Tensor:
            """hidden [s, b, h] (the decoder's output); input_ids, labels, weights [b, s];
            `loss_fn(hidden, labels, weights)` the model's weighted loss sum through its shared
            output layer; returns loss_weight / D * the sum over depths of each depth's loss."""
            from loongforge.core.foundation.layers import _cu_seqlens

            sample = None
            if packed_seq_params is not None:  # a target must lie in the position's own sample
                cu = _cu_seqlens(packed_seq_params)
                pos = torch.arange(input_ids.shape[1], device=input_ids.device)
                sample = (torch.searchsorted(cu[1:].to(pos.device).contiguous(), pos, right=True))[None]
            ids, lab, w, same = input_ids, labels, weights.float(), sample
            total = hidden.new_zeros((), dtype=torch.float32)
            self.losses = []
            for depth in self.layers:
                ids, lab, w = _shift(ids, 0), _shift(lab, 0), _shift(w, 0.0)
                if sample is not None:
                    same = _shift(same, -1)
                    w = w * (same == sample)
                emb = embedding(input_ids=ids, position_ids=None)
                x, _ = depth.eh_proj(torch.cat([depth.enorm(emb), depth.hnorm(hidden)], dim=-1))
                hidden, _ = depth.layer(hidden_states=x, attention_mask=None, packed_seq_params=packed_seq_params)
                out = depth.final_layernorm(hidden)
                loss = loss_fn(out, lab, w)
                self.losses.append(loss.detach())
                total = total + loss
            return total * (self.loss_weight / len(self.layers))

    return MultiTokenPrediction
