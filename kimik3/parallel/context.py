"""Every distributed concern of a training run, behind one object the training loop calls.

The loop (``kimik3.train.trainer``) is written for one process. Wherever several processes must
split work or agree, it asks its context:

=========================  ====================================  ==============================================
method                     one process (``ParallelContext``)     distributed (``DistributedContext``)
=========================  ====================================  ==============================================
``wrap_model``             activation checkpointing if asked     KCP, MoonEP, checkpointing, FSDP2 (``parallelize``)
``shard_batch``            the batch                             this rank's dp rows, then its cp segment
``shard_sequence``         the batch                             this rank's cp segment (all dp ranks: same rows)
``backward_loss``          the loss                              x cp (FSDP averages; cp shares must add up)
``global_loss``            the value                             summed over cp shares, averaged over dp
``clip_grad_norm``         torch's                               over DTensors on several meshes
``sum_counts``             nothing                               all-reduce (Quantile Balancing's histogram)
``broadcast_int/str``      the value                             rank 0's value
``barrier``, ``is_main``   nothing, True                         ``dist.barrier``, rank == 0
``full_model_state``       None (the writer reads the model)     every DTensor gathered onto rank 0
``full_optimizer_state``   ``state_dict()``                      every DTensor gathered
=========================  ====================================  ==============================================

``training_context(device, dims)`` picks one: distributed when a process group exists or torchrun
launched this process (world size 1 included, so one GPU runs the very code path of many).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kimik3.parallel.mesh import ParallelDims


class ParallelContext:
    """One process: the batch is the global batch, every value is already global, nothing is sent."""

    def __init__(self, device: torch.device, dims: ParallelDims | None = None):
        dims = dims if dims is not None else ParallelDims(dp=1)
        dims.check_world(1)
        self.device = device
        self.dims = dims
        self.rank = 0

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files and logs (rank 0)."""
        return self.rank == 0

    @property
    def can_generate(self) -> bool:
        """Whether ``model.generate`` runs here (not under context parallelism, which has no cache)."""
        return self.dims.cp == 1

    # ------------------------------------------------------------------ the model
    def wrap_model(self, model: nn.Module, *, activation_checkpointing: str | bool = "none",
                   ep_planner: str = "moonep") -> nn.Module:
        """Apply what this context needs to ``model`` (in place; returned). ``activation_checkpointing``: a
        mode of ``kimik3.parallel.activation_checkpoint`` ("none", "full", "selective", "every:N")."""
        from kimik3.parallel.activation_checkpoint import apply_activation_checkpointing

        return apply_activation_checkpointing(model, activation_checkpointing)

    # ------------------------------------------------------------------ data
    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of each [B, T] tensor of the step's global batch."""
        return tensors

    def shard_sequence(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's segment of each [B, T] tensor, the rows unchanged (every dp rank sees them all)."""
        return tensors

    # ------------------------------------------------------------------ losses and gradients
    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate, so that the reduced gradients are the whole batch's."""
        return loss

    def global_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The whole batch's value of a loss this rank computed on its part (detached)."""
        return value

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients to a total norm of ``max_norm``; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def sum_counts(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over every rank that sees different tokens (routing counts)."""

    # ------------------------------------------------------------------ agreement
    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        return value

    def broadcast_str(self, value: str) -> str:
        """Rank 0's ``value`` on every rank."""
        return value

    def barrier(self) -> None:
        """Wait until every rank gets here."""

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Run the block on rank 0 first, then on the others (rank 0 fills a cache the others read)."""
        yield

    # ------------------------------------------------------------------ checkpoints
    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The full weights to write (on rank 0), or None when the checkpoint writer may read ``model``."""
        return None

    def full_optimizer_state(self, optimizer: Any) -> Any:
        """The optimizer state in the single-process layout (every rank calls it)."""
        return optimizer.state_dict()


class DistributedContext(ParallelContext):
    """A rank of a dp x cp process group (ep borrowing the dp ranks): see ``kimik3.parallel.mesh``.

    The global batch of a step is split over the dp ranks by rows (``batch // dp`` each, so the
    mean of their mean losses is the single-process loss) and each row over the cp ranks by
    segments (the loss a cp rank computes is its share of its rows' loss, shares adding up).
    """

    def __init__(self, device: torch.device, dims: ParallelDims | None = None):
        import torch.distributed as dist

        from kimik3.parallel.mesh import build_mesh, dp_rank

        world = dist.get_world_size()
        dims = dims if dims is not None else ParallelDims.for_world(world)
        dims.check_world(world)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.dims = dims
        self.rank = dist.get_rank()
        self.mesh = build_mesh(dims, device.type)
        self.dp_rank = dp_rank(self.mesh)

    def wrap_model(self, model: nn.Module, *, activation_checkpointing: str | bool = "none",
                   ep_planner: str = "moonep") -> nn.Module:
        from kimik3.parallel.apply import parallelize

        # Every rank built the same weights from the same seed; FSDP keeps each rank's shard.
        return parallelize(model, self.dims, self.mesh, activation_checkpointing=activation_checkpointing,
                           ep_planner=ep_planner)

    def shard_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dp = self.dims.dp
        if dp > 1:
            batch = tensors[0].shape[0]
            if batch % dp:
                raise ValueError(f"the batch of {batch} sequences does not split over dp={dp} ranks: "
                                 f"choose a --batch-size (or --tokens-per-step) divisible by {dp}")
            rows = batch // dp
            tensors = tuple(t[self.dp_rank * rows:(self.dp_rank + 1) * rows] for t in tensors)
        return self.shard_sequence(*tensors)

    def shard_sequence(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Labels are already shifted on the whole sequence, as KCP wants.
        if self.dims.cp == 1:
            return tensors
        from kimik3.parallel.kcp import shard_sequence
        from kimik3.parallel.mesh import cp_mesh

        group = cp_mesh(self.mesh).get_group()
        return tuple(shard_sequence(t, group, dim=1) for t in tensors)

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # FSDP averages gradients over dp x cp; the cp shares must be summed, hence the factor.
        return loss * self.dims.cp if self.dims.cp > 1 else loss

    def global_loss(self, value: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        from kimik3.parallel.mesh import loss_group

        value = value.detach().float().clone()
        dist.all_reduce(value, group=loss_group(self.mesh))
        return value / self.dims.dp

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        from kimik3.optim.clip import clip_grad_norm

        # Sharded gradients, possibly on several meshes (FSDP, EP).
        return clip_grad_norm(parameters, max_norm)

    def sum_counts(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        from kimik3.parallel.mesh import balance_group

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=balance_group(self.mesh))

    def broadcast_int(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def broadcast_str(self, value: str) -> str:
        # Bytes through a tensor: no pickle.
        import torch.distributed as dist

        data = torch.tensor(list(value.encode()), dtype=torch.uint8) if self.is_main else None
        size = self.broadcast_int(len(data) if data is not None else 0)
        buf = (data if data is not None else torch.empty(size, dtype=torch.uint8)).to(self.device)
        dist.broadcast(buf, src=0)
        return bytes(buf.cpu().tolist()).decode()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    @contextmanager
    def main_first(self) -> Iterator[None]:
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from kimik3.parallel.full_state import full_model_state

        return full_model_state(model)   # collective; the tensors land on rank 0 only

    def full_optimizer_state(self, optimizer: Any) -> Any:
        from kimik3.parallel.full_state import full_optimizer_state

        return full_optimizer_state(optimizer)   # collective (DTensor moments gathered whole)


def training_context(device: torch.device, dims: ParallelDims | None = None) -> ParallelContext:
    """The context of this process: it joins the process group torchrun describes (gloo on CPU, nccl
    on CUDA) and is distributed then, or when a group exists already; otherwise one process.

    ``dims``: the parallel degrees (default: dp = world size); their product must be the world size.
    """
    from kimik3.parallel.mesh import init_distributed

    if init_distributed(device.type):
        return DistributedContext(device, dims)
    return ParallelContext(device, dims)


def exit_rank(code: int = 0) -> None:
    """End this process now, after flushing logging and stdio, skipping the interpreter's finalisation. Call it
    once a rank's work is written and its process groups are destroyed: during finalisation torch 2.13's gloo
    sometimes aborts a rank ("terminate called without an active exception", exit -6), which would fail a run,
    test or benchmark that succeeded."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["DistributedContext", "ParallelContext", "exit_rank", "training_context"]

