"""The K3 model: one file per mechanism, assembled in ``k3.py``."""

from kimik3.model.cache import K3Cache, KDAState, MLAState
from kimik3.model.k3 import K3ForCausalLM, K3Output, default_dtype

__all__ = ["K3Cache", "K3ForCausalLM", "K3Output", "KDAState", "MLAState", "default_dtype"]
