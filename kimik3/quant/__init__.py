"""Quantisation: the OCP Microscaling formats (``mx``) and quantisation-aware training of the routed experts."""

from kimik3.quant.mx import FORMATS, MXTensor, dequantize, fake_quantize, quantize

__all__ = ["FORMATS", "MXTensor", "dequantize", "fake_quantize", "quantize"]
