"""Data utilities shared by every modality: global batches split into per-rank micro-batches,
sequence packing, text data (`data.text`: tokenizers, chat formats and templates, SFT packs),
media decoding (`data.media`: videos with PyAV, images with PIL, as uint8 RGB frames), and
data-parallel load balancing of samples of unequal cost (`data.balance`). Resumable samplers are
not built yet."""

from loongforge.core.data.balance import SampleCost, assign, balanced_rank_samples, imbalance, imbalance_lower_bound
from loongforge.core.data.batching import rank_micro_batches
from loongforge.core.data.packing import Pack, best_fit_decreasing, pack_samples, packing_efficiency

__all__ = [
    "rank_micro_batches",
    "SampleCost",
    "assign",
    "balanced_rank_samples",
    "imbalance",
    "imbalance_lower_bound",
    "Pack",
    "best_fit_decreasing",
    "pack_samples",
    "packing_efficiency",
]
