"""Quintic Newton–Schulz orthogonalisation and the block layouts that cut a parameter into matrices.

Legend: H = heads (or blocks), E = experts, m x n = the shape of one orthogonalised block.

- ``newton_schulz``: quintic Newton–Schulz on [..., m, n] (every matrix on its own).
- ``normalize_split`` / ``block_layout`` / ``BlockLayout``: how a parameter is cut into [H, m, n]
  blocks under a group's ``split`` ("whole", per-head "rows" / "cols", per-"experts") and put back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Keller Jordan's quintic coefficients: they maximise the slope at zero, so 5 steps push every
# singular value into roughly [0.7, 1.2] rather than converging exactly to 1 (good enough for
# an update direction, and what torch.optim.Muon uses).
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_NS_EPS = 1e-7

SPLIT_KINDS = ("whole", "rows", "cols", "experts")
_NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


# --------------------------------------------------------------------------- Newton–Schulz
def newton_schulz(G: torch.Tensor, steps: int = DEFAULT_NS_STEPS,
                  coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                  eps: float = DEFAULT_NS_EPS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate orthogonal factor of each matrix of ``G`` by quintic Newton–Schulz.

    G: [m, n] or [..., m, n], any float dtype. Every trailing [m, n] matrix is treated on its
    own (its own Frobenius normalisation, its own iteration), but all of them run as one
    batched matmul chain. Returns [..., m, n] in ``dtype`` (bf16 by default, like
    torch.optim.Muon; pass torch.float32 for accurate orthogonality in tests).

    Per matrix: X = G / max(||G||_F, eps) (so the spectral norm is <= 1), iterated as
    A = X X^T, X <- a X + (b A + c A^2) X, working on the wide orientation (transposed when
    m > n, so the Gram matrix is the smaller one). For a single matrix in bf16 this is
    numerically identical to torch.optim.Muon's ``_zeropower_via_newtonschulz``.

    A matrix's result depends on that matrix and its memory layout only, not on the rest of the
    batch (on the CPU, bit for bit: the batched matmul treats each matrix on its own), which is what
    lets ``Muon.step`` stack the blocks of many parameters into one call. The layout does count in
    fp32: a strided view (per-head column blocks) rounds differently from a contiguous copy.
    """
    if not isinstance(G, torch.Tensor) or G.ndim < 2:
        raise ValueError(f"newton_schulz: G must be a tensor of shape [..., m, n], "
                         f"got {getattr(G, 'shape', type(G).__name__)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"newton_schulz: steps must be an int >= 0, got {steps!r}")
    if len(coefficients) != 3:
        raise ValueError(f"newton_schulz: coefficients must be three numbers (a, b, c), got {coefficients!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"newton_schulz: dtype must be a floating dtype, got {dtype}")
    a, b, c = (float(v) for v in coefficients)
    rows, cols = G.shape[-2:]
    batch_shape = G.shape[:-2]

    X_BMN = G.to(dtype).reshape(math.prod(batch_shape), rows, cols)  # not -1: rows * cols may be 0
    transposed = rows > cols
    if transposed:
        X_BMN = X_BMN.mT
    # Frobenius norm >= spectral norm, so this puts every singular value in [0, 1] where the
    # polynomial is designed to act; the clamp keeps an all-zero gradient at zero.
    norm_B11 = torch.linalg.vector_norm(X_BMN, dim=(-2, -1), keepdim=True).clamp(min=eps)
    X_BMN = X_BMN / norm_B11
    for _ in range(steps):
        gram_BMM = torch.bmm(X_BMN, X_BMN.mT)
        poly_BMM = torch.baddbmm(gram_BMM, gram_BMM, gram_BMM, beta=b, alpha=c)
        X_BMN = torch.baddbmm(X_BMN, poly_BMM, X_BMN, beta=a)
    if transposed:
        X_BMN = X_BMN.mT
    return X_BMN.reshape(*batch_shape, rows, cols)


# --------------------------------------------------------------------------- block layouts
def normalize_split(split: Any) -> tuple:
    """Validate a split spec and return it as a tuple: ("whole",), ("rows", H), ("cols", H) or ("experts",).

    Lists are accepted too (a split that went through JSON comes back as a list).
    """
    if isinstance(split, str) or not isinstance(split, (tuple, list)) or len(split) == 0:
        raise ValueError(f"split must be a tuple such as ('whole',), ('rows', H), ('cols', H) or "
                         f"('experts',), got {split!r}")
    kind = split[0]
    if kind not in SPLIT_KINDS:
        raise ValueError(f"split kind {kind!r} is unknown; expected one of {SPLIT_KINDS}")
    if kind in ("rows", "cols"):
        if len(split) != 2:
            raise ValueError(f"split ({kind!r}, H) needs exactly one head count H, got {split!r}")
        heads = split[1]
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"split ({kind!r}, H): head count H must be an int >= 1, got {heads!r}")
        return (kind, heads)
    if len(split) != 1:
        raise ValueError(f"split ({kind!r},) takes no argument, got {split!r}")
    return (kind,)


@dataclass(frozen=True)
class BlockLayout:
    """How one parameter is cut into ``blocks`` matrices of shape [rows, cols] and put back."""

    split: tuple
    blocks: int
    rows: int
    cols: int

    def to_blocks(self, t: torch.Tensor) -> torch.Tensor:
        """Parameter-shaped tensor -> [blocks, rows, cols] (a view where the layout allows)."""
        kind = self.split[0]
        if kind == "whole" or kind == "rows":
            return t.reshape(self.blocks, self.rows, self.cols)
        if kind == "cols":
            # [out, H*X] -> [out, H, X] -> [H, out, X]: head h's columns become matrix h.
            return t.reshape(self.rows, self.blocks, self.cols).permute(1, 0, 2)
        return t  # experts: already [E, a, b]

    def from_blocks(self, t_BMN: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[blocks, rows, cols] -> the parameter's ``shape`` (inverse of ``to_blocks``)."""
        if self.split[0] == "cols":
            t_BMN = t_BMN.permute(1, 0, 2)
        return t_BMN.reshape(shape)

    @property
    def lr_ratio(self) -> float:
        """sqrt(max(rows, cols)) of one block: the block, not the whole tensor, is what is orthogonal."""
        return math.sqrt(max(self.rows, self.cols))


def block_layout(split: Any, shape: torch.Size | tuple[int, ...], name: str = "parameter") -> BlockLayout:
    """The ``BlockLayout`` of a parameter of ``shape`` under ``split``; ValueError if they do not fit."""
    kind, *args = normalize_split(split)
    shape = tuple(shape)
    if kind == "experts":
        if len(shape) != 3:
            raise ValueError(f"{name}: split ('experts',) needs a 3-D [E, a, b] tensor, got shape {shape}")
        return BlockLayout(("experts",), shape[0], shape[1], shape[2])
    if len(shape) != 2:
        raise ValueError(f"{name}: split {tuple([kind, *args])} needs a 2-D matrix, got shape {shape}")
    out_dim, in_dim = shape
    if kind == "whole":
        return BlockLayout(("whole",), 1, out_dim, in_dim)
    heads = args[0]
    if kind == "rows":
        if out_dim % heads:
            raise ValueError(f"{name}: split ('rows', {heads}): {out_dim} rows are not divisible by {heads} heads")
        return BlockLayout(("rows", heads), heads, out_dim // heads, in_dim)
    if in_dim % heads:
        raise ValueError(f"{name}: split ('cols', {heads}): {in_dim} columns are not divisible by {heads} heads")
    return BlockLayout(("cols", heads), heads, out_dim, in_dim // heads)


def _ns_dtype_name(dtype: Any) -> str:
    # Param groups hold the name, not the torch.dtype, so a group stays JSON-friendly.
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if name not in _NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {sorted(_NS_DTYPES)} (or the torch dtype), got {dtype!r}")
    return name
