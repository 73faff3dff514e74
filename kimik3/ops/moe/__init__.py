"""MoE ops: the grouped matmul over expert-sorted rows."""

from kimik3.ops.moe.grouped_mm import grouped_mm, grouped_mm_loop

__all__ = ["grouped_mm", "grouped_mm_loop"]
