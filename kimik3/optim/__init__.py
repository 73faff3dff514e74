"""Optimizers: K3's per-head Muon for matrices and AdamW for the rest (``muon.py``)."""

from kimik3.optim.muon import (
    DEFAULT_NS_COEFFICIENTS,
    BlockLayout,
    MultiOptimizer,
    Muon,
    ParamRule,
    block_layout,
    build_param_groups,
    classify_parameters,
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
