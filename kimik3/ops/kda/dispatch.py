"""Which KDA kernels run, as data: one table of (stage, implementation, when it applies), and the functions that read
it. The forward and backward pipelines (``forward.py``, ``backward.py``) ask ``select`` which implementation takes
each stage; ``explain`` prints the same answer for any inputs, so "which kernels run for a training forward on an
H100 in bf16?" is one call::

    python -m kimik3.ops.kda.dispatch --device cuda --capability 9.0 --dtype bfloat16 --T 8192 --H 96 --grad

Backends (``kda_backend``): the Triton kernels for CUDA tensors when triton is installed and the chunk is 64 tokens,
else the chunkwise torch path (``chunk.py``); ``KIMIK3_KDA_BACKEND`` (torch / triton / auto) overrides the choice,
the one environment override of the KDA operators. Within the Triton backend, each stage runs the first
implementation of its rows in ``TABLE`` that applies; the Hopper Gluon kernels (``gluon/``) apply from a number of
work items up, below which a call is bound by the host (a Gluon launch encodes its TMA descriptors on the host).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

BACKEND_ENV = "KIMIK3_KDA_BACKEND"

# Work items (chunks x heads x 64-column blocks, or chunks x heads) from which a Gluon kernel replaces its Triton
# stage: below them the forward is host-bound, and the Gluon launch's descriptor encoding costs more than it saves.
GLUON_MIN_ITEMS = 4096
GLUON_SCAN_MIN_ITEMS = 6144  # the scans (chunks x heads x 64-column V blocks)
_min_items = {"items": GLUON_MIN_ITEMS, "scan": GLUON_SCAN_MIN_ITEMS}  # what the rows compare with (``thresholds``)
# The widest K whose every key column fits one intra-backward program, so that the fused L2 norm's and sigmoid's chain
# rules run inside it (``bwd_intra.fuses_preact``); wider, ``preact_bwd.py`` runs them as a pass of their own.
PREACT_INSIDE_MAX_K = 128


_TRITON_FOUND = importlib.util.find_spec("triton") is not None   # read once: torch.compile traces a constant


def triton_available() -> bool:
    return _TRITON_FOUND


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether this Triton has Gluon (``triton.experimental.gluon``), which the Hopper kernels are written in."""
    try:
        return importlib.util.find_spec("triton.experimental.gluon") is not None
    except ModuleNotFoundError:
        return False


def kda_backend(q: torch.Tensor, chunk_size: int = 64, backend: Optional[str] = None) -> str:
    """The backend ``chunk_kda`` uses for these inputs: "triton" or "torch".

    ``backend`` (else the environment variable KIMIK3_KDA_BACKEND, else "auto"): "auto" picks Triton for CUDA tensors
    when triton is installed and chunk_size == 64, else torch. "triton" forces the Triton kernels (CPU tensors only
    work under TRITON_INTERPRET=1); errors are raised, never answered by a fallback.
    """
    choice = (backend or os.environ.get(BACKEND_ENV) or "auto").lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"KDA backend must be 'auto', 'torch' or 'triton', got {choice!r}")
    if choice == "auto":
        return "triton" if (q.is_cuda and chunk_size == 64 and triton_available()) else "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("KDA backend 'triton' requested but triton is not installed")
        if chunk_size != 64:
            raise ValueError(f"the Triton KDA kernels use chunk_size 64, got {chunk_size}")
    return choice


@dataclass(frozen=True)
class Call:
    """What decides the kernels of one chunked KDA call: the device, the inputs' dtype and sizes, and whether a
    backward will read the forward's intermediates (``grad``)."""

    capability: Optional[Tuple[int, int]]  # the CUDA device's compute capability; None on the CPU
    dtype: torch.dtype  # q, k, v
    K: int
    V: int
    H: int
    chunks: int  # 64-token chunks over all sequences (NT)
    grad: bool
    scale: float = 1.0
    gluon: bool = True  # this Triton has Gluon

    @staticmethod
    def of(q: torch.Tensor, v: torch.Tensor, chunks: int, grad: bool, scale: float = 1.0) -> "Call":
        cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
        return Call(cap, q.dtype if q.dtype == v.dtype else torch.float32, q.shape[-1], v.shape[-1], q.shape[-2],
                    chunks, grad, scale, gluon_available())

    def blocks(self, d: int) -> int:
        """64-column blocks of a dimension of d columns."""
        return -(-d // 64)


Why = Optional[str]  # None: the row applies; else why it does not


def _hopper_bf16(c: Call) -> Why:
    if c.capability != (9, 0):
        return "needs a Hopper GPU (sm_90)"
    if not c.gluon:
        return "needs a Triton with Gluon"
    if c.dtype != torch.bfloat16:
        return "needs bf16 q, k, v"
    return None


def _all(*checks: Callable[[Call], Why]) -> Callable[[Call], Why]:
    def check(c: Call) -> Why:
        for f in checks:
            why = f(c)
            if why is not None:
                return why
        return None
    return check


def _k128(c: Call) -> Why:
    return None if c.K == 128 else f"needs K = 128 (K = {c.K})"


def _kv128(c: Call) -> Why:
    return None if c.K == 128 and c.V == 128 else f"needs K = V = 128 (K = {c.K}, V = {c.V})"


def _items(n: Callable[[Call], int], which: str, what: str) -> Callable[[Call], Why]:
    def check(c: Call) -> Why:
        got, least = n(c), _min_items[which]
        return None if got >= least else f"needs >= {least} {what} ({got})"
    return check


def _rows_below(n: Callable[[Call], int], what: str) -> Callable[[Call], Why]:
    # TMA coordinates and some stores' offsets are 32-bit
    def check(c: Call) -> Why:
        return None if n(c) < 2**31 else f"needs fewer than 2^31 {what} ({n(c)})"
    return check


# the forward scan's stored states (when a backward reads them) and its Aqk rows
_SCAN_ROWS = _rows_below(lambda c: c.chunks * c.H * (c.K if c.grad else 64), "rows of stored states and Aqk")
_BWD_WY_ROWS = _all(_rows_below(lambda c: c.chunks * c.H * c.K, "rows of stored states"),
                    _rows_below(lambda c: c.chunks * c.H * 4096, "elements of dAqk and dA"))


def _alone(c: Call) -> Why:
    return None if not c.grad else "needs a forward alone (a backward reads the 64-token chunks' intermediates)"


def _scan_items(c: Call) -> int:
    return c.chunks * c.H * c.blocks(c.V)


def _always(c: Call) -> Why:
    return None


@dataclass(frozen=True)
class Row:
    stage: str
    impl: str  # "gluon/<module>", "<module>" (Triton), or for "forward" which pipeline
    when: Callable[[Call], Why]
    doc: str


# One row per (stage, implementation), in pipeline order; the first row of a stage that applies runs it.
_GLUON_WY = _all(_hopper_bf16, lambda c: None if c.K == c.V and c.K % 64 == 0 else
                 f"needs K == V, a multiple of 64 (K = {c.K}, V = {c.V})",
                 _items(lambda c: c.chunks * c.H * c.blocks(c.K), "items", "chunks x heads x 64-column blocks"))
_SCAN_SHAPE = _all(_hopper_bf16, lambda c: None if c.K == 128 and c.V % 64 == 0 else
                   f"needs K = 128 and V a multiple of 64 (K = {c.K}, V = {c.V})",
                   _items(_scan_items, "scan", "chunks x heads x 64-column V blocks"))
_GLUON_SCAN = _all(_SCAN_SHAPE, _SCAN_ROWS)
# the 16-token scan's TMA loads address its tiles' [NT16 H 16, D] rows in 32 bits
_TILES16 = _all(_alone, _SCAN_SHAPE, _rows_below(lambda c: c.chunks * 4 * c.H * 16, "rows of 16-token tiles"))
TABLE: List[Row] = [
    # forward
    Row("forward", "16-token tiles", _TILES16,
        "a forward alone on 16-token tiles: prep16.py forms every tile's operands, gluon/scan16.py scans and outputs"),
    Row("forward", "64-token chunks", _always, "the stages below"),
    Row("prologue", "prologue", _always, "gate, Gamma = chunk cumsum, q / k L2 norms, beta sigmoid"),
    Row("intra", "intra", _always, "Aqk and diag(beta) Akk per 64 x 16 column tile"),
    Row("solve", "solve", _always, "T = (I + A)^-1 in 16 x 16 register blocks"),
    Row("wy", "gluon/wy", _GLUON_WY, "W, U, qg, kg, exp(Gamma_C) by a TMA ring and wgmma"),
    Row("wy", "wy", _always, "W, U, qg, kg, exp(Gamma_C) per 64-column K or V block"),
    Row("scan", "gluon/scan", _GLUON_SCAN, "the state scan with the output in one kernel"),
    Row("scan", "fwd_scan", _always, "the state scan storing h and v_new, then the output kernel in parallel"),
    # backward
    Row("bwd_scan", "gluon/bwd_scan", _all(_hopper_bf16, _kv128, lambda c: None if c.scale != 0 else
                                           "needs a non-zero scale",
                                           _items(_scan_items, "scan", "chunks x heads x 64-column V blocks")),
        "scale Aqk^T dO, the state-gradient scan and dRv = T^T dv_new in one kernel"),
    Row("bwd_scan", "bwd_scan", _always, "scale Aqk^T dO, the state-gradient scan, then dRv = T^T dv_new"),
    Row("bwd_wy", "gluon/bwd_wy", _all(_hopper_bf16, _kv128, _BWD_WY_ROWS,
                                       _items(lambda c: c.chunks * c.H, "items", "chunks x heads")),
        "the WY backward, one item per (chunk, head): dA and dbeta whole"),
    Row("bwd_wy", "bwd_wy", _always, "the WY backward in parts: one per 64-column key block, one for the V side"),
    Row("bwd_intra", "gluon/bwd_intra", _all(_hopper_bf16, _k128,
                                             _items(lambda c: c.chunks * c.H, "items", "chunks x heads")),
        "the gradients through Aqk and A (and the fused L2 / sigmoid chain rules)"),
    Row("bwd_intra", "bwd_intra", _always, "the gradients through Aqk and A per 16-row tile and key block"),
    Row("suffix", "bwd_intra", _always, "dg = suffix sum of dGamma over the chunk (and the fused gate's chain rule)"),
    Row("preact", "bwd_intra", lambda c: None if c.K <= PREACT_INSIDE_MAX_K else
        f"needs K <= {PREACT_INSIDE_MAX_K} (K = {c.K})",
        "the fused pre-activations' chain rules inside the intra backward and the suffix sum"),
    Row("preact", "preact_bwd", _always, "the fused L2 norm's and sigmoid's chain rules as a pass of their own"),
]
FORWARD_STAGES = ("prologue", "intra", "solve", "wy", "scan")
BACKWARD_STAGES = ("bwd_scan", "bwd_wy", "bwd_intra", "suffix", "preact")


@contextlib.contextmanager
def thresholds(items: int = GLUON_MIN_ITEMS, scan_items: int = GLUON_SCAN_MIN_ITEMS):
    """Within the block, the Gluon rows apply from these work-item counts (``GLUON_MIN_ITEMS``,
    ``GLUON_SCAN_MIN_ITEMS``) instead: ``thresholds(0, 0)`` runs every Gluon kernel that can take a call at any size,
    as the precision and training checks do at shapes small enough to compare with the token loop."""
    saved = dict(_min_items)
    _min_items.update(items=items, scan=scan_items)
    select.cache_clear()
    try:
        yield
    finally:
        _min_items.update(saved)
        select.cache_clear()


@dataclass(frozen=True)
class Choice:
    impl: str
    doc: str
    passed_over: Tuple[Tuple[str, str], ...]  # (implementation, why not) of the rows before it


@functools.lru_cache(maxsize=256)
def select(call: Call) -> Dict[str, Choice]:
    """stage -> the implementation that runs it for this call (the first row of the stage that applies). Cached: the
    pipelines ask on every call, on the host's critical path."""
    out: Dict[str, Choice] = {}
    skipped: Dict[str, list] = {}
    for row in TABLE:
        if row.stage in out:
            continue
        why = row.when(call)
        if why is None:
            out[row.stage] = Choice(row.impl, row.doc, tuple(skipped.get(row.stage, ())))
        else:
            skipped.setdefault(row.stage, []).append((row.impl, why))
    return out


def explain(device: str = "cuda", capability: Optional[Tuple[int, int]] = (9, 0), dtype: torch.dtype = torch.bfloat16,
            B: int = 1, T: int = 8192, H: int = 96, K: int = 128, V: int = 128, grad: bool = True,
            chunk_size: int = 64, gluon: Optional[bool] = None) -> str:
    """Which kernel runs at every stage of ``chunk_kda`` for inputs of these sizes (B sequences of T tokens) on this
    device, and why: the answer ``select`` gives the pipelines, as text."""
    lines = [f"chunk_kda on {device}" + (f" (sm_{capability[0]}{capability[1]})" if device == "cuda" and capability
                                         else "") + f", {str(dtype).replace('torch.', '')}, B={B} T={T} H={H} K={K} "
             f"V={V}, {'training (forward + backward)' if grad else 'forward alone'}"]
    if device != "cuda" or chunk_size != 64 or not triton_available():
        reason = ("not a CUDA device" if device != "cuda" else
                  f"chunk_size {chunk_size} != 64" if chunk_size != 64 else "triton not installed")
        lines.append(f"  backend    torch (chunk.py: chunk_kda_torch; {reason}; {BACKEND_ENV}=triton forces Triton)")
        return "\n".join(lines)
    call = Call(capability, dtype, K, V, H, B * -(-T // 64), grad, 1.0, gluon_available() if gluon is None else gluon)
    sel = select(call)
    lines.append("  backend    triton (Triton / Gluon kernels)")

    def line(stage: str) -> str:
        ch = sel[stage]
        text = f"  {stage:<10} {ch.impl:<16} {ch.doc}"
        for impl, why in ch.passed_over:
            text += f"\n  {'':<10} {'':<16} (not {impl}: {why})"
        return text

    lines.append(line("forward"))
    if sel["forward"].impl == "16-token tiles":
        return "\n".join(lines)
    lines += [line(s) for s in FORWARD_STAGES]
    if grad:
        lines += [line(s) for s in BACKWARD_STAGES]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimik3.ops.kda.dispatch",
                                description="Print which KDA kernel runs at every stage for the given inputs.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where the tensors live")
    p.add_argument("--capability", default="9.0", help="CUDA compute capability, e.g. 9.0 (H100/H200), 8.0 (A100)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="q, k, v dtype")
    p.add_argument("--B", type=int, default=1, help="sequences")
    p.add_argument("--T", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--H", type=int, default=96, help="heads")
    p.add_argument("--K", type=int, default=128, help="key head dim")
    p.add_argument("--V", type=int, default=128, help="value head dim")
    p.add_argument("--grad", action="store_true", help="a training call (the backward runs too)")
    a = p.parse_args(argv)
    try:
        major, minor = (int(x) for x in a.capability.split("."))
    except ValueError:
        p.error(f"--capability takes MAJOR.MINOR, e.g. 9.0, got {a.capability!r}")
    print(explain(a.device, (major, minor), getattr(torch, a.dtype), a.B, a.T, a.H, a.K, a.V, a.grad))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
