"""What the Hopper Gluon kernels of KDA share: persistent work items, TMA rings and their barriers, the bf16 hi / lo
split, TMA descriptors and the persistent launch.

Every kernel here is warp-specialised the same way: a 1-warp loader partition streams an item's tiles by TMA into a
ring of shared-memory slots (a "ready" and an "empty" mbarrier per slot) while consumer warpgroups multiply on
``warpgroup_mma``. The chunk-local kernels (``wy``, ``bwd_wy``, ``bwd_intra``) run a persistent grid of CTAs over
their work items (``_item``, ``_my_items``); the scans run one program per chain (``_sequence``). Gluon does not run
under the Triton interpreter: the tests run these kernels through ``tests/gluon_emulator.py`` and compile them for
sm_90.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _item(item, H, cidx_ptr, cu_ptr, NP: gl.constexpr):
    """Work item -> (global chunk, head, column block, the chunk's first token, its valid rows)."""
    p = item % NP
    ch = item // NP
    i_h = ch % H
    i_t = ch // H
    i_n = gl.load(cidx_ptr + 2 * i_t)
    t0 = gl.load(cu_ptr + i_n) + gl.load(cidx_ptr + 2 * i_t + 1) * 64
    L = gl.minimum(gl.load(cu_ptr + i_n + 1) - t0, 64)
    return i_t, i_h, p, t0, L


@gluon.jit
def _item_ahead(pid, nprog, i, n_items, H, cidx_ptr, cu_ptr):
    """``_item`` of this persistent program's i-th item (``_my_items``), clamped to the last item: a consumer reads
    its next item's metadata while working on the current one, so that the loads' latency is hidden."""
    return _item(gl.minimum(pid + i * nprog, n_items - 1), H, cidx_ptr, cu_ptr, 1)


@gluon.jit
def _my_items(n_items):
    """This persistent program's share of n_items: (program id, program count, how many items it takes); its
    i-th item is pid + i * nprog."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    return pid, nprog, (n_items - pid + nprog - 1) // nprog


@gluon.jit
def _wait_slot(bars, i, FREE: gl.constexpr):
    """The ring slot of a program's i-th item (one barrier per slot in bars), once its barrier says so: FREE for
    the loader (the consumer has handed the slot back; a fresh slot's "previous" phase counts as done), else for
    the consumer (its tiles have landed)."""
    n: gl.constexpr = bars.shape[0]
    slot = i % n
    mbarrier.wait(bars.index(slot), ((i // n) & 1) ^ FREE)
    return slot


@gluon.jit
def split16(x):
    """fp32 x as a bf16 high part and the bf16 remainder (hi + lo holds ~16 mantissa bits): Gluon's twin of
    ``triton_common._split16``."""
    hi = x.to(gl.bfloat16)
    return hi, (x - hi.to(gl.float32)).to(gl.bfloat16)


@gluon.jit
def ring_barriers(RING: gl.constexpr, RELEASERS: gl.constexpr):
    """A ring's barriers, initialised: "ready" (one arrival, the loader's expect, plus the TMA bytes) and "empty"
    (RELEASERS arrivals: every consumer partition hands the slot back), one of each per slot."""
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(RING):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=RELEASERS)
    return ready, empty


@gluon.jit
def release_ring(ready, empty):
    """Invalidate a ring's barriers (``ring_barriers``) at the kernel's end."""
    n: gl.constexpr = ready.shape[0]
    for s in gl.static_range(n):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def _sequence(cu_ptr, coff_ptr, H, C: gl.constexpr = 64):
    """This program's head, its sequence's first and end tokens and its count of C-token chunks, and the sequence's
    first global chunk (coff_ptr: the plan's chunk_off)."""
    i_nh = gl.program_id(1)
    i_n = i_nh // H
    bos = gl.load(cu_ptr + i_n)
    eos = gl.load(cu_ptr + i_n + 1)
    return i_nh % H, bos, eos, (eos - bos + C - 1) // C, gl.load(coff_ptr + i_n)


def tile_descriptor(x: torch.Tensor, dtype, shape: tuple, block: Sequence[int] = (64, 64),
                    swizzled: bool = True) -> TensorDescriptor:
    """A TMA descriptor of ``block`` tiles (default [64, 64]) over x viewed as the 2-D ``shape``; unswizzled when not
    ``swizzled`` (32-bit rows that a consumer reads one at a time)."""
    x2 = x.view(shape)
    block = list(block)
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype) if swizzled else \
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), block, layout)


def run(kernel, grid: tuple, args: tuple, launcher: Optional[Callable], **meta) -> None:
    """Launch a Gluon kernel on ``grid``. launcher: how to run it (None: on the GPU; the tests pass
    ``tests/gluon_emulator.emulate`` to run it on the CPU, or a compiler that only compiles it)."""
    if launcher is None:
        kernel[grid](*args, **meta)
    else:
        launcher(kernel, grid, *args, **meta)


def run_persistent(kernel, n_items: int, device: torch.device, args: tuple, launcher: Optional[Callable],
                   programs: Optional[int], ctas_per_sm: int = 1, **meta) -> None:
    """Launch a persistent Gluon kernel over n_items on min(programs, n_items) programs (``run``'s launcher);
    programs: the persistent grid (None: ctas_per_sm CTAs per SM of ``device``)."""
    if programs is None:
        programs = torch.cuda.get_device_properties(device).multi_processor_count * ctas_per_sm
    run(kernel, (min(programs, n_items),), args, launcher, **meta)
