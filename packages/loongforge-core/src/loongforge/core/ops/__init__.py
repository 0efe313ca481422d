"""The op table: named ops with a plain-torch reference each; faster implementations register
through the plugin registry (kind "op", an `OpImpl`): the fastest one for the device is chosen
by default, and config overrides per op (`ops.<name>=<impl>`, `ops.<name>=reference`)."""

from loongforge.core.ops.table import REFERENCE_OPS, OpImpl, OpTable

__all__ = ["OpTable", "OpImpl", "REFERENCE_OPS"]
