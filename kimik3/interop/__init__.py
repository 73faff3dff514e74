"""State-dict and config adapters between kimik3 and external Kimi K3 layouts: the released Hugging Face
checkpoint (``hf``) and torchtitan's port (``torchtitan``). The name-and-shape rules live once, in ``layout``."""

from kimik3.interop.hf import config_from_hf, from_hf, hf_config, to_hf
from kimik3.interop.torchtitan import from_torchtitan, to_torchtitan

__all__ = ["config_from_hf", "from_hf", "from_torchtitan", "hf_config", "to_hf", "to_torchtitan"]
