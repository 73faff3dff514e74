"""Numeric helpers shared by the tests."""

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F


def away_from_init(model: torch.nn.Module) -> torch.nn.Module:
    """Move a K3 model off the values init leaves (zero AttnRes queries, zero router biases), which hide paths and
    carried tensors from a comparison; in place (torch's global RNG), returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(std=0.5)
        for router in model.routers():
            router.expert_bias.normal_(std=0.05)
    return model


def cu_seqlens(lengths: Sequence[int], device="cpu") -> torch.Tensor:
    """The int32 cu_seqlens of a packed batch of sequences of these lengths: [0, l0, l0 + l1, ...]."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """rms(ref - out) / rms(ref), in fp64 (fla's comparison metric)."""
    ref64, out64 = ref.detach().double(), out.detach().double()
    denom = ref64.square().mean().sqrt().clamp_min(1e-30)
    return float((ref64 - out64).square().mean().sqrt() / denom)


def kda_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.float32, seed: int = 0,
               gate_spread: float = 1.5, device: str = "cpu",
               gate_dtype: Optional[torch.dtype] = None) -> List[torch.Tensor]:
    """Random KDA inputs shaped as the K3 layer produces them: q, k L2-normalised over K; v ~ N(0, 1);
    g = -5 sigmoid(.) in (-5, 0); beta = sigmoid(.). Leaf tensors with requires_grad=True on ``device``:
    q, k, v in ``dtype``, g and beta in ``gate_dtype`` (default: ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    q_BTHK = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k_BTHK = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v_BTHV = torch.randn(B, T, H, V, generator=gen)
    g_BTHK = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) * gate_spread)
    beta_BTH = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    dtypes = [dtype] * 3 + [gate_dtype or dtype] * 2
    return [x.to(device=device, dtype=dt).requires_grad_()
            for x, dt in zip((q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH), dtypes)]
