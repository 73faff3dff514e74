"""kimik3: an open, faithful, tested implementation of the Kimi K3 system in PyTorch."""

from kimik3.config import K3Config, param_counts
from kimik3.model import K3ForCausalLM

__version__ = "0.1.0"
__all__ = ["K3Config", "K3ForCausalLM", "param_counts", "__version__"]
