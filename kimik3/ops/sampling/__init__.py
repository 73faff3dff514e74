"""Sampling ops: the argmax over a vocabulary row, split over the row (``argmax``)."""

from kimik3.ops.sampling.argmax import argmax_backend, row_argmax

__all__ = ["argmax_backend", "row_argmax"]
