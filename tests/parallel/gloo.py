"""Run a function on N gloo ranks (forked processes) and collect what each rank returns.

``run_ranks(worker, world, tmp_path, *args)`` calls ``worker(rank, world, *args)`` in every rank
after ``init_process_group("gloo")``; the worker returns a dict of tensors, which travels back
through safetensors (never pickle). The ranks are forked from the test process: they start with its
imports and state (a spawned rank re-imports torch and kimik3, seconds of CPU a rank, more than most
of these tests compute) and each runs one intra-op thread, set before any torch op (the parent's
OpenMP threads do not survive a fork). The ranks compute on the CPU: a forked process cannot use a
CUDA context its parent made.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _entry(worker: Callable, rank: int, world: int, init_file: str, out_file: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = worker(rank, world, *args)
        save_file({k: v.detach().contiguous().cpu() for k, v in result.items()}, out_file)
    except BaseException:
        Path(out_file + ".error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # The result is written and the group destroyed: end the rank before gloo's finalisation can fail it.
    from kimik3.parallel.context import exit_rank

    exit_rank()


def run_ranks(worker: Callable, world: int, tmp_path: Path, *args,
              timeout: float = 300) -> list[dict[str, torch.Tensor]]:
    ctx = mp.get_context("fork")   # (the module docstring says why not spawn)
    init_file = tmp_path / f"init-{worker.__name__}-{world}"
    outs = [tmp_path / f"{worker.__name__}-{world}-r{rank}.safetensors" for rank in range(world)]
    procs = [ctx.Process(target=_entry, args=(worker, rank, world, str(init_file), str(outs[rank]), args))
             for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            raise AssertionError(f"rank {rank} did not finish within {timeout} s")
        error = Path(str(outs[rank]) + ".error")
        if p.exitcode != 0:
            detail = error.read_text() if error.exists() else ""
            raise AssertionError(f"rank {rank} exited with {p.exitcode}\n{detail}")
    return [load_file(out) for out in outs]
