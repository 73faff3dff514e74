"""Optimizers: K3's per-head Muon for matrices (``muon.py``; its Newton–Schulz and block layouts in
``newton_schulz.py``), AdamW for the rest, and ``MultiOptimizer`` driving both (``multi.py``)."""

from kimik3.optim.multi import MultiOptimizer
from kimik3.optim.muon import Muon, ParamRule, build_param_groups, classify_parameters
from kimik3.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    BlockLayout,
    block_layout,
    newton_schulz,
    normalize_split,
)

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "BlockLayout",
    "MultiOptimizer",
    "Muon",
    "ParamRule",
    "block_layout",
    "build_param_groups",
    "classify_parameters",
    "newton_schulz",
    "normalize_split",
]
