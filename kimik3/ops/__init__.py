"""Compute kernels (attention variants, MoE) used by the Kimi K3 model."""
