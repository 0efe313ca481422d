"""The op table: named ops with a plain-torch reference each; faster implementations register
through the plugin registry (kind "op") and are chosen per op by config (`ops.<name>=<impl>`)."""

from loongforge.core.ops.table import OpTable, REFERENCE_OPS

__all__ = ["OpTable", "REFERENCE_OPS"]
