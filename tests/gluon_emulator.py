"""Run Gluon kernels on the CPU: an emulator of the part of Triton 3.6's Gluon language our kernels use.

Gluon (``triton.experimental.gluon``) does not run under ``TRITON_INTERPRET=1``, so without this a Gluon kernel
could only be compiled in CI, never executed. ``emulate(kernel, grid, *args, **kwargs)`` runs the kernel's Python
body once per program id, with the Gluon operations it calls replaced by torch operations on CPU tensors, the way
Triton's interpreter runs ``tl`` kernels:

- tensors are whole tiles (layouts are accepted and ignored: they decide where values live, not what they are);
  ``gl.load`` / ``gl.store`` check every masked-in lane against the bounds of the tensor behind the pointer;
- shared memory is a tensor that starts as NaN (integers: a sentinel), so a tile read before it is written shows;
- ``warpgroup_mma`` and ``mma_v2`` multiply in fp32, with fp32 operands rounded to tf32 as the tensor cores round
  them;
- ``inline_asm_elementwise`` runs the PTX snippets our kernels use (``ASM``: each emulated by torch operations with
  the instructions' rounding); any other raises;
- mbarriers keep Hopper's phase rule: a phase completes when its expected arrivals and transaction bytes are all
  in; ``wait(bar, parity)`` returns once the phase of that parity is complete (a fresh barrier's "previous" phase,
  parity 1, counts as complete). A TMA load lands in shared memory only when a wait sees its phase complete, so
  a tile read without waiting is stale; a TMA store reads its shared buffer only at its own partition's
  ``store_wait`` (or the kernel's end), so a buffer reused before the store has drained corrupts the result, as
  on the GPU;
- Ampere's ``async_copy`` (cp.async): a copy reads global memory when issued (masked-off lanes: zeros) and lands
  in shared memory only when ``wait_group`` retires its committed group, so a tile read before its wait is stale
  and a wait that leaves too many groups in flight shows;
- ``gl.warp_specialize`` runs each partition in its own thread; a wait that could never complete (the kernel
  would hang on the GPU) raises ``GluonDeadlock`` after ``timeout`` seconds;
- like a GPU launch, a kernel records no autograd: its arguments may require grad (a launch from inside an
  autograd Function's forward), its outputs do not come to.

Not modelled: integer overflow (offsets are int64 here), the register / shared-memory budgets (``--compile`` in
the kernel's script reports those), memory-model races other than the two TMA ones above.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import threading
from typing import Any, Callable

import torch

from triton.experimental import gluon  # noqa: F401  (the language modules below need it imported)
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonJITFunction
from triton.experimental.gluon.language.nvidia import ampere, hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier as gl_mbarrier
from triton.experimental.gluon.language.nvidia.hopper import tma as gl_tma
from triton.language.core import constexpr

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int64": torch.int64,
           "int32": torch.int32, "int16": torch.int16, "int1": torch.bool, "int8": torch.int8, "uint8": torch.uint8}


class GluonDeadlock(RuntimeError):
    """A barrier wait that cannot complete: on the GPU the kernel would hang."""


def _torch_dtype(dtype) -> torch.dtype:
    dtype = dtype.value if isinstance(dtype, constexpr) else dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    name = getattr(dtype, "name", str(dtype))
    if name not in _DTYPES:
        raise NotImplementedError(f"gluon emulator: dtype {name!r}")
    return _DTYPES[name]


def _val(x):
    """A tile's torch tensor, or a Python / constexpr scalar as itself."""
    if isinstance(x, Tile):
        return x.t
    return x.value if isinstance(x, constexpr) else x


class Tile:
    """A register tile: a torch tensor with the operators and methods Gluon tensors have."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    dtype = property(lambda self: self.t.dtype)
    shape = property(lambda self: list(self.t.shape))

    def to(self, dtype, bitcast=False, **_):
        dt = _torch_dtype(dtype)
        if _val(bitcast):  # the same bits as another type of the same width
            if dt.itemsize != self.t.dtype.itemsize:
                raise ValueError(f"gluon emulator: bitcast {self.t.dtype} -> {dt} changes the width")
            return Tile(self.t.view(dt))
        return Tile(self.t.to(dt))

    def __index__(self):
        return int(self.t)

    def __bool__(self):
        return bool(self.t)

    def __repr__(self):
        return f"Tile({self.t!r})"


def _operand(x) -> bool:
    return isinstance(x, (Tile, torch.Tensor, int, float, bool, constexpr))


def _binary(op: Callable) -> Callable:
    return lambda a, b: Tile(op(_val(a), _val(b))) if _operand(b) else NotImplemented  # (tile + pointer: below)


def _rbinary(op: Callable) -> Callable:
    return lambda a, b: Tile(op(_val(b), _val(a))) if _operand(b) else NotImplemented


def _int_div(a, b):
    return torch.div(a, b, rounding_mode="trunc") if _is_int(a) and _is_int(b) else a / b


def _int_mod(a, b):
    return torch.fmod(a, b) if _is_int(a) and _is_int(b) else torch.remainder(a, b)


def _is_int(x) -> bool:
    return isinstance(x, int) or (isinstance(x, torch.Tensor) and not x.is_floating_point())


for _name, _op in {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
                   "floordiv": _int_div, "mod": _int_mod, "and": torch.bitwise_and, "or": torch.bitwise_or,
                   "xor": torch.bitwise_xor, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
                   "eq": torch.eq, "ne": torch.ne, "lshift": torch.bitwise_left_shift,
                   "rshift": torch.bitwise_right_shift}.items():
    setattr(Tile, f"__{_name}__", _binary(_op))
    if _name not in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(Tile, f"__r{_name}__", _rbinary(_op))
Tile.__neg__ = lambda self: Tile(-self.t)
Tile.__invert__ = lambda self: Tile(~self.t)


def _span(t: torch.Tensor) -> torch.Tensor:
    """A flat view of the memory a strided tensor spans, from its first element to its last (itself when
    contiguous): what a kernel given its pointer and strides addresses."""
    if t.is_contiguous():
        return t
    if any(st < 0 for st in t.stride()):
        raise ValueError("gluon emulator: negative strides")
    n = 0 if t.numel() == 0 else 1 + sum((size - 1) * st for size, st in zip(t.shape, t.stride()))
    return t.as_strided((n,), (1,))


class Pointer:
    """A pointer argument (a flat view of the memory a torch tensor spans) plus element offsets, a scalar or a
    tile of them."""

    def __init__(self, base: torch.Tensor, name: str, offset=0):
        self.base, self.name, self.offset = base, name, offset

    def __add__(self, other):
        return Pointer(self.base, self.name, _val(other) + _val(self.offset))

    __radd__ = __add__

    @property
    def dtype(self):  # ``ptr.dtype.element_ty``: the torch dtype, which ``Tile.to`` takes
        return type("PointerType", (), {"element_ty": self.base.dtype})

    def __sub__(self, other):
        return Pointer(self.base, self.name, _val(self.offset) - _val(other))

    def lanes(self, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, mask) as int64 / bool tensors of one shape; masked-in lanes must lie inside the tensor."""
        offs = torch.as_tensor(_val(self.offset), dtype=torch.int64)
        m = torch.ones_like(offs, dtype=torch.bool) if mask is None else torch.as_tensor(_val(mask))
        offs, m = torch.broadcast_tensors(offs, m)
        bad = m & ((offs < 0) | (offs >= self.base.numel()))
        if bad.any():
            raise IndexError(f"gluon emulator: {int(bad.sum())} masked-in lane(s) outside {self.name} "
                             f"({self.base.numel()} elements), e.g. offset {int(offs[bad][0])}")
        return offs, m


class Shared:
    """A shared-memory allocation or a view of one (``.index(i)``)."""

    def __init__(self, t: torch.Tensor, layout=None):
        self.t, self.layout = t, layout

    dtype = property(lambda self: self.t.dtype)
    shape = property(lambda self: list(self.t.shape))

    def index(self, i):
        return Shared(self.t[int(_val(i))], self.layout)

    def load(self, layout=None):
        return Tile(self.t.clone())

    def store(self, value):
        self.t.copy_(torch.as_tensor(_val(value)).to(self.t.dtype).expand_as(self.t))

    def permute(self, order):
        return Shared(self.t.permute(*[int(_val(o)) for o in order]), self.layout)

    def slice(self, start, length, dim=0):
        return Shared(self.t.narrow(int(_val(dim)), int(_val(start)), int(_val(length))), self.layout)

    def reshape(self, shape):  # a view of the same elements in another shape (row-major)
        return Shared(self.t.view([int(_val(x)) for x in shape]), self.layout)

    def _reinterpret(self, dtype, shape, layout=None, **_):  # the same bytes as another dtype and shape (row-major)
        shape = [int(_val(x)) for x in shape]
        assert self.t.is_contiguous() and self.t.numel() * self.t.element_size() == math.prod(shape) * \
            _torch_dtype(dtype).itemsize, (self.shape, shape)
        return Shared(self.t.view(_torch_dtype(dtype)).view(shape), layout)


class _Barrier:
    """One mbarrier: its expected arrival count, the arrivals and transaction bytes still pending in the current
    phase, the phase number, and the TMA loads that land when a wait sees their phase complete."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0
        self.loads: list[tuple[int, Callable[[], None]]] = []

    def settle(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count


class _Machine:
    """The emulated CTA: program id, grid, barriers (keyed by the shared slot that holds them), pending TMA
    stores, and the condition every barrier wait sleeps on."""

    def __init__(self, timeout: float):
        self.pid, self.grid, self.timeout = (0, 0, 0), (1, 1, 1), timeout
        self.cond = threading.Condition()
        self.barriers: dict[int, _Barrier] = {}
        self.stores: dict[int, list[Callable[[], None]]] = {}  # per thread: a partition waits for its own stores
        self.copies: list[Callable[[], None]] = []             # cp.async copies issued, not yet committed
        self.groups: list[list[Callable[[], None]]] = []       # committed cp.async groups, oldest first

    def barrier(self, bar: Shared) -> _Barrier:
        key = bar.t.data_ptr()
        if key not in self.barriers:
            raise RuntimeError("gluon emulator: mbarrier used before mbarrier.init")
        return self.barriers[key]

    # mbarrier ------------------------------------------------------------
    def init(self, bar, count=1, **_):
        with self.cond:
            self.barriers[bar.t.data_ptr()] = _Barrier(int(_val(count)))

    def invalidate(self, bar, **_):
        with self.cond:
            self.barriers.pop(bar.t.data_ptr(), None)

    def expect(self, bar, nbytes, pred=True, **_):  # arrive.expect_tx: one arrival, nbytes to come
        if not _val(pred):
            return
        with self.cond:
            b = self.barrier(bar)
            b.tx += int(_val(nbytes))
            b.pending -= 1
            b.settle()
            self.cond.notify_all()

    def arrive(self, bar, count=1, pred=True, **_):
        if not _val(pred):
            return
        with self.cond:
            b = self.barrier(bar)
            b.pending -= int(_val(count))
            b.settle()
            self.cond.notify_all()

    def wait(self, bar, phase, pred=True, deps=None, **_):
        if not _val(pred):
            return
        parity = int(_val(phase)) & 1
        with self.cond:
            b = self.barrier(bar)
            # the phase of this parity is complete when the current phase has the other parity
            if not self.cond.wait_for(lambda: (b.phase & 1) != parity, timeout=self.timeout):
                raise GluonDeadlock(f"gluon emulator: mbarrier wait for parity {parity} never completed "
                                    f"(phase {b.phase}, {b.pending} arrivals and {b.tx} bytes pending)")
            landed = [load for ph, load in b.loads if ph < b.phase]
            b.loads = [(ph, load) for ph, load in b.loads if ph >= b.phase]
            for load in landed:  # under the lock: another partition waiting on the same phase must see them landed
                load()

    # TMA -------------------------------------------------------------------
    @staticmethod
    def _box(desc, coord):
        base = desc.base
        block = [int(_val(x)) for x in desc.block_shape]
        start = [int(_val(c)) for c in _val(coord)]
        src = tuple(slice(max(s, 0), min(s + n, d)) for s, n, d in zip(start, block, base.shape))
        dst = tuple(slice(sl.start - s, sl.stop - s) for sl, s in zip(src, start))
        return base, block, src, dst

    def tma_load(self, desc, coord, bar, result, pred=True, **_):
        if not _val(pred):
            return
        base, block, src, dst = self._box(desc, coord)
        if list(result.t.shape) != block:
            raise ValueError(f"gluon emulator: TMA box {block} into shared memory of shape {list(result.t.shape)}")
        box = torch.zeros(block, dtype=base.dtype)  # out-of-bounds elements are zero-filled
        box[dst] = base[src]
        nbytes = box.numel() * box.element_size()  # the whole box counts, in bounds or not

        def land(result=result, box=box):
            result.t.copy_(box.to(result.t.dtype))

        with self.cond:
            b = self.barrier(bar)
            b.loads.append((b.phase, land))
            b.tx -= nbytes
            b.settle()
            self.cond.notify_all()

    def tma_store(self, desc, coord, src, **_):
        base, block, gsrc, dst = self._box(desc, coord)

        def drain(base=base, gsrc=gsrc, dst=dst, src=src):  # reads the shared buffer only now
            base[gsrc] = src.t[dst].to(base.dtype)

        with self.cond:
            self.stores.setdefault(threading.get_ident(), []).append(drain)

    def store_wait(self, pendings=0, everyone=False, **_):
        """The calling partition's TMA stores but the last ``pendings`` read their buffers and land (as
        ``tma.store_wait``: a warp waits for its own bulk copies); everyone: every partition's (the kernel's end)."""
        keep = int(_val(pendings))
        with self.cond:
            owners = list(self.stores) if everyone else [threading.get_ident()]
            drain = []
            for owner in owners:
                mine = self.stores.get(owner, [])
                cut = len(mine) - keep if keep else len(mine)
                drain += mine[:cut]
                self.stores[owner] = mine[cut:]
        for d in drain:
            d()

    # Ampere cp.async -------------------------------------------------------
    def cp_async(self, smem, pointer, mask=None, **_):
        value = _load(pointer, mask, 0).t

        def land(dst=smem.t, value=value):
            dst.copy_(value.to(dst.dtype))
        self.copies.append(land)

    def commit_group(self, **_):
        self.groups.append(self.copies)
        self.copies = []

    def wait_group(self, num_outstanding=0, **_):
        keep = int(_val(num_outstanding))
        cut = max(len(self.groups) - keep, 0)
        for group in self.groups[:cut]:
            for land in group:
                land()
        self.groups = self.groups[cut:]


def _load(ptr: Pointer, mask=None, other=None, **_):
    offs, m = ptr.lanes(mask)
    flat = ptr.base.reshape(-1)
    out = flat[torch.where(m, offs, 0)]
    fill = 0 if other is None else _val(other)
    return Tile(torch.where(m, out, torch.as_tensor(fill, dtype=out.dtype)))


def _store(ptr: Pointer, value, mask=None, **_):
    offs, m = ptr.lanes(mask)
    v = torch.as_tensor(_val(value)).to(ptr.base.dtype).expand(offs.shape)
    ptr.base.reshape(-1)[offs[m]] = v[m]


def _atomic_add(ptr: Pointer, val, mask=None, **_):
    """``gl.atomic_add``: each unmasked lane's value added at its address (lanes sharing an address all land);
    returns the old values."""
    offs, m = ptr.lanes(mask)
    flat = ptr.base.reshape(-1)
    old = flat[torch.where(m, offs, 0)].clone()
    v = torch.as_tensor(_val(val)).to(ptr.base.dtype).expand(offs.shape)
    flat.index_add_(0, offs[m], v[m])
    return Tile(old)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to tf32's 10 mantissa bits (round to nearest even), as the tensor cores take fp32 operands."""
    if x.dtype != torch.float32:
        return x.float()
    i = x.view(torch.int32)
    i = (i + 0x0FFF + ((i >> 13) & 1)) & ~0x1FFF
    return i.view(torch.float32)


def _mma(a, b, acc, use_acc=True, is_async=False, **_):
    prod = _tf32(_val(a) if isinstance(a, Tile) else a.t) @ _tf32(b.t)
    return Tile(prod + _val(acc).float() if _val(use_acc) else prod)


def _mma_v2(a, b, acc, input_precision=None, **_):
    return Tile(_tf32(_val(a)) @ _tf32(_val(b)) + _val(acc).float())


def _mma_wait(num_outstanding=0, deps=None, **_):
    """``warpgroup_mma_wait``: the products are done already (``_mma`` computes at issue); returns the dependencies
    as Gluon does, one alone or several as a tuple."""
    if deps is None:
        raise ValueError("warpgroup_mma_wait deps must be given")
    return deps[0] if len(deps) == 1 else tuple(deps)


def _bf16x2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int32 tensor's two bf16 halves (low, high) as fp32."""
    lo = (x & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()
    hi = (x >> 16).to(torch.int16).view(torch.bfloat16).float()
    return lo, hi


def _pack_bf16x2(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """fp32 halves rounded to bf16 (nearest even) and packed into an int32, low half first."""
    lo16 = lo.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    hi16 = hi.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return lo16 | (hi16 << 16)


def _mul_bf16x2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mul.rn.bf16x2``: each half's product rounded to bf16 (an fp32 product of two bf16 is exact)."""
    a_lo, a_hi = _bf16x2(a)
    b_lo, b_hi = _bf16x2(b)
    return _pack_bf16x2(a_lo * b_lo, a_hi * b_hi)


_TWO_126_X2 = torch.tensor(0x7E807E80, dtype=torch.int32)  # 2^126 in both bf16 halves


# The inline PTX the kernels use -> its torch emulation (operands as torch tensors, in the asm's order).
ASM = {
    "mul.rn.bf16x2 $0, $1, $2;": _mul_bf16x2,
    "{ .reg .b32 c, t; mov.b32 c, 0x7E807E80; mul.rn.bf16x2 t, $1, c; mul.rn.bf16x2 $0, t, $2; }":
        lambda a, b: _mul_bf16x2(_mul_bf16x2(a, _TWO_126_X2), b),
}


def _inline_asm(asm, constraints, args, dtype, is_pure=True, pack=1, **_):
    asm = _val(asm)
    if asm not in ASM:
        raise NotImplementedError(f"gluon emulator: inline asm {asm!r} (known: tests/gluon_emulator.py ASM)")
    ts = torch.broadcast_tensors(*[torch.as_tensor(_val(a)) for a in args])
    return Tile(ASM[asm](*ts).to(_torch_dtype(dtype)))


def _shared_alloc(dtype, shape, layout=None, value=None, **_):
    dt = _torch_dtype(dtype)
    fill = float("nan") if dt.is_floating_point else -0x5A5A
    t = torch.full([int(_val(s)) for s in shape], fill, dtype=dt)
    if value is not None:
        t.copy_(_val(value).to(dt))
    return Shared(t, layout)


def _unwrapped(fn: Callable) -> Callable:
    """A Gluon op on tiles, given as a function of torch tensors (scalars become tensors; keywords such as layouts
    are dropped)."""
    return lambda *args, **kw: Tile(fn(*[torch.as_tensor(_val(a)) for a in args]))


def _reduce(inputs, axis, combine_fn, keep_dims=False, **_):
    """``gl.reduce``: one tile or a tuple of tiles reduced along axis by combine_fn, a jit function of two groups of
    values (the running results, then the next slice), applied slice by slice in order."""
    single = not isinstance(inputs, (tuple, list))
    tiles = [_val(x) for x in ([inputs] if single else inputs)]
    axis = int(_val(axis))
    acc = [t.select(axis, 0) for t in tiles]
    for i in range(1, tiles[0].shape[axis]):
        out = combine_fn(*[Tile(a) for a in acc], *[Tile(t.select(axis, i)) for t in tiles])
        acc = [_val(o) for o in ((out,) if isinstance(out, Tile) else out)]
    acc = [a.unsqueeze(axis) if keep_dims else a for a in acc]
    return Tile(acc[0]) if single else tuple(Tile(a) for a in acc)


def _int32(x: int) -> Tile:
    """A scalar as the int32 tensor a kernel's program id is."""
    return Tile(torch.tensor(x, dtype=torch.int32))


def _static_assert(cond, msg="", **_):
    if not _val(cond):
        raise AssertionError(_val(msg))


def _warp_specialize(machine: _Machine, functions_and_args, worker_num_warps=None, worker_num_regs=None, **_):
    errors: list[BaseException] = []
    result: list[Any] = [None]

    def run(i, fn, args):
        try:
            with torch.no_grad():  # (grad mode is per thread: a kernel records no autograd in any partition)
                out = fn(*args)
            if i == 0:
                result[0] = out
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(exc)
            with machine.cond:
                machine.cond.notify_all()

    threads = [threading.Thread(target=run, args=(i, fn, args), daemon=True)
               for i, (fn, args) in enumerate(functions_and_args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(machine.timeout * 2)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise GluonDeadlock("gluon emulator: a warp-specialised partition did not finish")
    return result[0]


@contextlib.contextmanager
def _patched(machine: _Machine, fn_globals: dict):
    """Point the Gluon language at the emulator for the duration of a launch."""
    saved: list[tuple[Any, str, Any]] = []
    missing = object()

    def put(obj, name, value):
        saved.append((obj, name, obj.get(name, missing) if isinstance(obj, dict) else getattr(obj, name, missing)))
        if isinstance(obj, dict):
            obj[name] = value
        else:
            setattr(obj, name, value)

    ops = {
        "program_id": lambda axis=0, **_: _int32(machine.pid[int(_val(axis))]),
        "num_programs": lambda axis=0, **_: _int32(machine.grid[int(_val(axis))]),
        "arange": lambda start, end, layout=None, **_: Tile(torch.arange(int(_val(start)), int(_val(end)),
                                                                         dtype=torch.int32)),
        "zeros": lambda shape, dtype, layout=None, **_: Tile(torch.zeros([int(_val(s)) for s in shape],
                                                                          dtype=_torch_dtype(dtype))),
        "full": lambda shape, value, dtype, layout=None, **_: Tile(torch.full([int(_val(s)) for s in shape],
                                                                               _val(value), dtype=_torch_dtype(dtype))),
        "load": _load,
        "store": _store,
        "atomic_add": _atomic_add,
        "expand_dims": lambda x, axis, **_: Tile(_val(x).unsqueeze(int(_val(axis)))),
        "convert_layout": lambda x, layout=None, **_: x,
        "split": lambda a, **_: (Tile(_val(a)[..., 0]), Tile(_val(a)[..., 1])),
        "join": lambda a, b, **_: Tile(torch.stack(torch.broadcast_tensors(torch.as_tensor(_val(a)),
                                                                           torch.as_tensor(_val(b))), -1)),
        "reshape": lambda x, shape, **_: Tile(_val(x).reshape([int(_val(d)) for d in shape])),
        "broadcast": lambda a, b, **_: tuple(Tile(t) for t in torch.broadcast_tensors(torch.as_tensor(_val(a)),
                                                                                      torch.as_tensor(_val(b)))),
        "inline_asm_elementwise": _inline_asm,
        "permute": lambda x, *dims, **_: Tile(_val(x).permute(*[int(_val(d)) for d in
                                                                 (dims[0] if len(dims) == 1 else dims)])),
        "exp": _unwrapped(torch.exp),
        "exp2": _unwrapped(torch.exp2),
        "log": _unwrapped(torch.log),
        "sqrt": _unwrapped(torch.sqrt),
        "rsqrt": _unwrapped(torch.rsqrt),
        "abs": _unwrapped(torch.abs),
        "where": lambda c, a, b, **_: Tile(torch.where(_val(c), torch.as_tensor(_val(a)), torch.as_tensor(_val(b)))),
        "maximum": _unwrapped(torch.maximum),
        "minimum": _unwrapped(torch.minimum),
        "sum": lambda x, axis=None, **_: Tile(_val(x).sum(int(_val(axis))) if axis is not None else _val(x).sum()),
        "reduce": _reduce,
        "max": lambda x, axis=None, **_: Tile(_val(x).amax(int(_val(axis))) if axis is not None else _val(x).max()),
        "static_range": lambda *a, **_: range(*[int(_val(x)) for x in a]),
        "allocate_shared_memory": _shared_alloc,
        "warp_specialize": lambda *a, **k: _warp_specialize(machine, *a, **k),
        "static_assert": _static_assert,
        "thread_barrier": lambda **_: None,  # a partition's threads run as one here
    }
    for name, op in ops.items():
        put(gl, name, op)
    for name in ("init", "invalidate", "expect", "arrive", "wait"):
        put(gl_mbarrier, name, getattr(machine, name))
    put(gl_tma, "async_copy_global_to_shared", machine.tma_load)
    put(gl_tma, "async_copy_shared_to_global", machine.tma_store)
    put(gl_tma, "store_wait", machine.store_wait)
    put(ampere.async_copy, "async_copy_global_to_shared", machine.cp_async)
    put(ampere.async_copy, "commit_group", machine.commit_group)
    put(ampere.async_copy, "wait_group", machine.wait_group)
    tensor_core = {"fence_async_shared": lambda *a, **k: None, "warpgroup_mma": _mma,
                   "warpgroup_mma_wait": _mma_wait, "mma_v2": _mma_v2}
    for obj in (hopper, ampere, fn_globals):  # the modules, and the names a kernel imported from them
        for name, value in tensor_core.items():
            if name in (obj if isinstance(obj, dict) else vars(obj)):
                put(obj, name, value)
    unwrapped: set[int] = set()

    def plain_globals(g: dict) -> None:  # module-level gl.constexpr values as the plain values jit code sees, and
        if id(g) not in unwrapped:        # the tensor-core names a called function's module imported
            unwrapped.add(id(g))
            for name, value in list(g.items()):
                if isinstance(value, constexpr):
                    put(g, name, value.value)
                elif name in tensor_core:
                    put(g, name, tensor_core[name])

    def call(self, *a, **k):
        plain_globals(self.fn.__globals__)
        return self.fn(*a, **k)

    plain_globals(fn_globals)
    put(GluonJITFunction, "__call__", call)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is missing:
                obj.pop(name) if isinstance(obj, dict) else delattr(obj, name)
            elif isinstance(obj, dict):
                obj[name] = value
            else:
                setattr(obj, name, value)


_LOCK = threading.Lock()  # one emulated launch at a time: the language modules are patched process-wide


def emulate(kernel: GluonJITFunction, grid, *args, timeout: float = 60.0, **kwargs) -> None:
    """Run ``kernel[grid](*args, **kwargs)`` on the CPU, its programs one after another (see the module docstring).
    Tensor arguments (CPU, any non-negative strides) are pointers to the memory they span; TMA descriptors
    (``TensorDescriptor``) are used as they are; everything else passes through."""
    if not isinstance(kernel, GluonJITFunction):
        raise TypeError(f"emulate takes a @gluon.jit kernel, got {type(kernel).__name__}")
    grid = tuple(int(g) for g in grid) if isinstance(grid, (tuple, list)) else (int(grid),)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"gluon emulator: a grid has one to three dimensions, got {grid}")
    grid += (1,) * (3 - len(grid))
    for option in ("maxnreg", "num_stages", "num_ctas"):  # launch options, not kernel parameters
        kwargs.pop(option, None)
    names = kernel.arg_names
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.device.type != "cpu":
            raise ValueError(f"gluon emulator: pointer arguments must be CPU tensors ({names[i]} is not)")
    wrapped = [Pointer(_span(a), names[i] if i < len(names) else f"arg{i}") if isinstance(a, torch.Tensor) else a
               for i, a in enumerate(args)]
    machine = _Machine(timeout)
    machine.grid = grid
    with _LOCK, _patched(machine, kernel.fn.__globals__), torch.no_grad():  # (a kernel records no autograd)
        for pid in itertools.product(*(range(g) for g in reversed(grid))):
            machine.pid = tuple(reversed(pid))  # axis 0 fastest, as the GPU numbers programs
            machine.barriers.clear()
            machine.copies, machine.groups = [], []   # a program's cp.async copies are its own
            kernel.fn(*wrapped, **kwargs)
            machine.store_wait(0, everyone=True)  # a kernel's outstanding TMA stores complete when it exits


def run_without_interpreter(args: list, tmp_path) -> str:
    """``python ARGS`` from the repository root without ``TRITON_INTERPRET`` (which the test session sets, and
    under which a cold Gluon compile fails) and with an empty Triton cache (as in CI); asserts it succeeds and
    returns its standard output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    proc = subprocess.run([sys.executable, *args], env=env, cwd=root, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def last_json_line(stdout: str) -> Any:
    """The JSON a compile step printed last."""
    return json.loads(stdout.strip().splitlines()[-1])
