"""Configuration: ``K3Config`` and its parts, presets, parameter counts."""

from kimik3.config.params import format_param_table, param_counts
from kimik3.config.schema import (
    AttnResConfig,
    K3Config,
    KDAConfig,
    LayerSpec,
    MLAConfig,
    MoEConfig,
    MTPConfig,
)

__all__ = [
    "AttnResConfig", "K3Config", "KDAConfig", "LayerSpec", "MLAConfig", "MoEConfig", "MTPConfig",
    "format_param_table", "param_counts",
]
