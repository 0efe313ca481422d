"""Data utilities shared by every modality: sequence packing (and, later, DP load balancing and
resumable samplers)."""

from loongforge.core.data.packing import Pack, best_fit_decreasing, pack_samples, packing_efficiency

__all__ = ["Pack", "best_fit_decreasing", "pack_samples", "packing_efficiency"]
