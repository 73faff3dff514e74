"""Parallel degrees, the process group and the DeviceMesh that every parallel wrapper shares.

Degrees (``ParallelDims``): ``dp`` data-parallel ranks (each sees different sequences), ``cp``
context-parallel ranks (each sees a different slice of the same sequences), ``ep`` expert-parallel
ranks. world = dp x cp. EP does not add ranks: it borrows the data-parallel ones (as torchtitan's
"ep borrows from dp_shard"), so ep must divide dp.

The mesh is built once as three named dims, slowest first::

    ("dp_mod_ep", "ep", "cp")      sizes (dp // ep, ep, cp)

and two flattened dims are registered on it:

    "dp"     = dp_mod_ep x ep        (which sequences a rank sees: the batch split)
    "dp_cp"  = dp_mod_ep x ep x cp   (every rank that sees different tokens)

Which group does what:
- batch split: a rank's coordinate on "dp" (``dp_rank``) picks its rows of the global batch;
  the cp ranks of one dp coordinate share those rows.
- FSDP2 shards parameters and averages gradients over "dp_cp" (cp ranks hold the same weights and
  see different tokens, so their gradients are summed like data-parallel ones).
- the logged loss and Quantile Balancing's histogram are all-reduced over "dp_cp".
- MoonEP's all-to-all runs over "ep".
Size-1 dims are kept, so the same names exist for every layout (world 1 included).
"""

from __future__ import annotations

import datetime
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp_mod_ep", "ep", "cp")


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Parallel degrees. ``dp * cp`` is the world size; ``ep`` divides ``dp`` (EP reuses dp ranks)."""

    dp: int
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "ep", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims: {name} must be an int >= 1, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(f"ParallelDims: ep={self.ep} must divide dp={self.dp} (expert parallelism "
                             "borrows the data-parallel ranks; it does not add ranks of its own)")

    @property
    def world(self) -> int:
        return self.dp * self.cp

    def check_world(self, world: int) -> None:
        if world != self.world:
            raise ValueError(f"ParallelDims: dp={self.dp} x cp={self.cp} = {self.world} ranks, but the world "
                             f"has {world} process(es); choose dp and cp with dp x cp = {world}")

    @classmethod
    def for_world(cls, world: int, dp: int | None = None, ep: int = 1, cp: int = 1) -> ParallelDims:
        """The degrees for ``world`` processes; dp defaults to world // cp."""
        if dp is None:
            if cp < 1 or world % cp:
                raise ValueError(f"ParallelDims: cp={cp} must divide the world size {world}")
            dp = world // cp
        dims = cls(dp=dp, ep=ep, cp=cp)
        dims.check_world(world)
        return dims

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_distributed(device_type: str) -> bool:
    """Join the process group torchrun describes, once. Returns whether this process is distributed.

    Distributed = a process group exists already (tests), or torchrun launched us (``WORLD_SIZE``
    and ``MASTER_ADDR`` in the environment; world size 1 included, so one GPU runs the very code
    path of many). gloo on CPU, nccl on CUDA (each rank on GPU ``LOCAL_RANK``).
    """
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return False
    timeout = datetime.timedelta(minutes=30)
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)  # device_id: no rank->GPU guess
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return True


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The ("dp_mod_ep", "ep", "cp") mesh with the flattened "dp" and "dp_cp" dims (module docstring).

    Needs an initialised process group whose size is ``dims.world``.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims.check_world(world)
    if not dist.is_initialized():
        raise ValueError("build_mesh: no process group; launch with torchrun or `kimik3 train --nproc N`")
    mesh = init_device_mesh(device_type, (dims.dp // dims.ep, dims.ep, dims.cp), mesh_dim_names=MESH_DIMS)
    # Slicing a flattened dim back out of the root mesh is deprecated: keep the flattened meshes.
    _FLATTENED[mesh] = {"dp": mesh["dp_mod_ep", "ep"]._flatten("dp"),
                        "dp_cp": mesh["dp_mod_ep", "ep", "cp"]._flatten("dp_cp"),
                        "ep_replicas": mesh["dp_mod_ep", "cp"]._flatten("ep_replicas")}
    return mesh


_FLATTENED: weakref.WeakKeyDictionary[DeviceMesh, dict[str, DeviceMesh]] = weakref.WeakKeyDictionary()


def _flat(mesh: DeviceMesh, name: str) -> DeviceMesh:
    if mesh in _FLATTENED:
        return _FLATTENED[mesh][name]
    if mesh.ndim == 1:  # already the 1-D mesh asked for (e.g. a test's own FSDP mesh)
        return mesh
    return mesh[name]


# ----------------------------------------------------------------------------- accessors
def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh of the ranks that see different sequences (the batch split)."""
    return _flat(mesh, "dp")


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh FSDP2 shards over: every rank that sees different tokens (dp x cp)."""
    return _flat(mesh, "dp_cp")


def ep_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["ep"]


def ep_replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh of the ranks holding the same expert shard (same "ep" coordinate): dp/ep x cp."""
    return _flat(mesh, "ep_replicas")


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["cp"]


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on "dp": which slice of the global batch it trains on."""
    return dp_mesh(mesh).get_local_rank()


def loss_group(mesh: DeviceMesh):
    """Process group the logged loss and metrics are averaged over (dp x cp)."""
    return fsdp_mesh(mesh).get_group()


def balance_group(mesh: DeviceMesh):
    """Quantile Balancing's histogram group: every rank that routes different tokens (dp x cp)."""
    return fsdp_mesh(mesh).get_group()
