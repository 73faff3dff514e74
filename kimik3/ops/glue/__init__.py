"""Glue ops: the per-layer AttnRes mix and RMSNorm, each fused into one Triton kernel forward (two backward).

Their torch references, and CPU paths, are the modules' own code (``kimik3.model.attnres.AttnResMix``,
``kimik3.model.norm.RMSNorm``), which call these kernels where ``glue_backend`` says "triton".
"""

from kimik3.ops.glue.attnres import MAX_ENTRIES, attnres_mix, attnres_mix_backward, attnres_mix_forward
from kimik3.ops.glue.common import MAX_WIDTH, glue_backend
from kimik3.ops.glue.rmsnorm import rms_norm, rms_norm_backward, rms_norm_forward

__all__ = [
    "MAX_ENTRIES",
    "MAX_WIDTH",
    "attnres_mix",
    "attnres_mix_backward",
    "attnres_mix_forward",
    "glue_backend",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
]
