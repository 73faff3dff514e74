"""Regions that must compute in fp32 even under autocast (router logits, AttnRes, the KDA ops)."""

from __future__ import annotations

import torch


def no_autocast(device: torch.device | str) -> torch.autocast:
    """Disable autocast for ``device``'s type: matmuls inside keep their inputs' (fp32) dtype."""
    return torch.autocast(device_type=torch.device(device).type, enabled=False)
