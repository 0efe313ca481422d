"""Data utilities shared by every modality: global batches split into per-rank micro-batches,
sequence packing, and text data (`data.text`: tokenizers, chat formats and templates, SFT packs).
DP load balancing and resumable samplers are not built yet."""

from loongforge.core.data.batching import rank_micro_batches
from loongforge.core.data.packing import Pack, best_fit_decreasing, pack_samples, packing_efficiency

__all__ = ["rank_micro_batches", "Pack", "best_fit_decreasing", "pack_samples", "packing_efficiency"]
