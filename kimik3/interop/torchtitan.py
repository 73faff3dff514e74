"""torchtitan's Kimi K3 port (``torchtitan/models/kimi_k3``): its model's state-dict layout.

The per-tensor rules are in ``layout.py``. What is particular to the port: it has no MTP module
(ours goes under ``kimik3_mtp.``, or is left out with ``include_mtp=False``), no unused layer-0
AttnRes pair, and always an output head (a tied config exports a copy of the embedding).
"""

from __future__ import annotations

from kimik3.config.schema import K3Config
from kimik3.interop.layout import Layout, Tensor, export, import_

TORCHTITAN_LAYOUT = Layout(
    name="torchtitan",
    column=1,
    layer_prefix="layers.{i}.",
    mtp_prefix="kimik3_mtp.",
    write_tied_head=True,
    placeholders=lambda state_dict, config: {},
    vision_prefixes=("vision_encoder.",),
)


def to_torchtitan(state_dict: dict[str, Tensor], config: K3Config, *,
                  include_mtp: bool = True) -> dict[str, Tensor]:
    """Our state dict -> torchtitan's port (text model). Dtypes are kept (the router bias is fp32);
    ``include_mtp=False`` leaves out our MTP module, which the port does not have. Raises ValueError
    when ``state_dict`` does not match ``config``."""
    return export(state_dict, config, TORCHTITAN_LAYOUT, include_mtp)


def from_torchtitan(state_dict: dict[str, Tensor], config: K3Config, *,
                    drop_vision: bool = False) -> dict[str, Tensor]:
    """torchtitan's state dict -> ours, with exactly our model's keys. Raises ValueError naming every missing
    key, unexpected key and shape mismatch; the only keys dropped are a tied head equal to the embedding and,
    with ``drop_vision``, the vision encoder."""
    return import_(state_dict, config, TORCHTITAN_LAYOUT, drop_vision)
