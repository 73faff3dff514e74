"""Glue ops: the per-layer elementwise and normalisation steps around the matmuls, each one Triton kernel.

- ``attnres``: the Block AttnRes mix (and, forward only, the mix with its RMSNorm); ``rmsnorm``: RMSNorm;
  ``gated_norm``: KDA's output norm times its gate; ``situ``: SiTU-GLU (times the MoE mixture weight) -- one launch
  forward, one or two backward;
- ``causal_conv``: KDA's causal short conv over T tokens (one launch forward, three backward);
- ``short_conv``: KDA's short conv over a pool of states, for one token (decode) or a verification's T tokens
  (forward only, serving).

Their torch references, and CPU paths, are the model's own code (``AttnResMix``, ``RMSNorm``,
``kda.gated_output_norm``, ``ffn.situ_glu_cast``, ``conv.apply_short_conv``, ``conv.short_conv_step``,
``conv.short_conv_steps``), which call these kernels where ``glue_backend`` says "triton".
"""

from kimik3.ops.glue.attnres import (MAX_ENTRIES, attnres_mix, attnres_mix_backward, attnres_mix_forward,
                                    attnres_mix_norm)
from kimik3.ops.glue.causal_conv import causal_conv, causal_conv_backward, causal_conv_forward
from kimik3.ops.glue.common import MAX_WIDTH, glue_backend
from kimik3.ops.glue.gated_norm import gated_rms_norm, gated_rms_norm_backward, gated_rms_norm_forward
from kimik3.ops.glue.rmsnorm import rms_norm, rms_norm_backward, rms_norm_forward
from kimik3.ops.glue.short_conv import short_conv_decode, short_conv_steps
from kimik3.ops.glue.situ import situ_glu as situ_glu_fused
from kimik3.ops.glue.situ import situ_glu_backward, situ_glu_forward

__all__ = [
    "MAX_ENTRIES",
    "MAX_WIDTH",
    "attnres_mix",
    "attnres_mix_backward",
    "attnres_mix_forward",
    "attnres_mix_norm",
    "causal_conv",
    "causal_conv_backward",
    "causal_conv_forward",
    "gated_rms_norm",
    "gated_rms_norm_backward",
    "gated_rms_norm_forward",
    "glue_backend",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "short_conv_decode",
    "short_conv_steps",
    "situ_glu_backward",
    "situ_glu_forward",
    "situ_glu_fused",
]
