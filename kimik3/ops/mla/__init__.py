"""MLA ops: the absorbed single-token decode attention over the serving engine's paged latent pool, and the write
of a forward's new latents into it."""

from kimik3.ops.mla.paged_decode import (
    check_paged_mla_inputs,
    default_num_splits,
    launch_paged_mla_decode,
    paged_mla_backend,
    paged_mla_decode,
    paged_mla_decode_torch,
)
from kimik3.ops.mla.paged_store import paged_slots, paged_store, paged_store_torch

__all__ = [
    "check_paged_mla_inputs",
    "default_num_splits",
    "launch_paged_mla_decode",
    "paged_mla_backend",
    "paged_mla_decode",
    "paged_mla_decode_torch",
    "paged_slots",
    "paged_store",
    "paged_store_torch",
]
