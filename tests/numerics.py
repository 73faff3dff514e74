"""Numeric helpers shared by the tests."""

import torch


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """rms(ref - out) / rms(ref), in fp64 (fla's comparison metric)."""
    ref64, out64 = ref.detach().double(), out.detach().double()
    denom = ref64.square().mean().sqrt().clamp_min(1e-30)
    return float((ref64 - out64).square().mean().sqrt() / denom)
