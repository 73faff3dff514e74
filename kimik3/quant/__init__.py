"""Quantisation: the OCP Microscaling formats (``mx``) and quantisation-aware training of the routed experts."""

from kimik3.quant.kernel_order import to_kernel_order, to_ocp_order
from kimik3.quant.mx import FORMATS, MXTensor, dequantize, fake_quantize, quantize

__all__ = ["FORMATS", "MXTensor", "dequantize", "fake_quantize", "quantize", "to_kernel_order", "to_ocp_order"]
