"""MoE ops: tokens to expert-sorted rows and back, the grouped matmul over those rows, the router's fused top-k
selection, the routed experts for a few tokens without a sort, and the grouped matmul over packed MXFP4 expert
weights."""

from kimik3.ops.moe.grouped_mm import ExpertGroups, grouped_mm, grouped_mm_loop, grouped_mm_on_device
from kimik3.ops.moe.mxfp4_grouped_mm import mxfp4_grouped_mm
from kimik3.ops.moe.permute import from_expert_rows, inverse_permutation, to_expert_rows
from kimik3.ops.moe.route import route_backend, sigmoid_topk
from kimik3.ops.moe.small_batch import SMALL_BATCH_MAX_ROWS, routed_experts_small


__all__ = ["SMALL_BATCH_MAX_ROWS", "ExpertGroups", "from_expert_rows", "grouped_mm", "grouped_mm_loop",
           "grouped_mm_on_device", "inverse_permutation", "mxfp4_grouped_mm", "route_backend", "routed_experts_small",
           "sigmoid_topk", "to_expert_rows"]
