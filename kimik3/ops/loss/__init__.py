"""Losses: ``linear_cross_entropy``, the output head's matmul and the cross-entropy over token chunks, never
materialising the [tokens, vocab] fp32 logits (CUDA: the per-chunk softmax and gradient in one Triton kernel)."""

from kimik3.ops.loss.linear_cross_entropy import (
    default_chunk_tokens,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)

__all__ = ["default_chunk_tokens", "linear_cross_entropy", "linear_cross_entropy_reference"]
