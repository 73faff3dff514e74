"""Training: data, tokenizer, the training loop, and Quantile Balancing of the MoE router biases."""

from kimik3.train.balance import (
    QuantileBalancer,
    SignBalancer,
    load_imbalance,
    quantile_bias_exact,
    quantile_bias_histogram,
    route_biased,
    sign_update,
)

__all__ = [
    "QuantileBalancer",
    "SignBalancer",
    "load_imbalance",
    "quantile_bias_exact",
    "quantile_bias_histogram",
    "route_biased",
    "sign_update",
]
