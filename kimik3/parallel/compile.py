"""``torch.compile`` of the K3 blocks (``kimik3 train --compile``): each block of the model compiled in place.

Each layer (mixer + FFN with its norms and AttnRes mixing) is compiled on its own (``nn.Module.compile``, inductor's
defaults), as torchtitan compiles its transformer blocks: the blocks' Triton kernels are custom operators
(``kimik3::...``) and the routers report their statistics through a reorderable logging function, so each block
traces into one graph with no break (``benchmarks/compile_probe.py`` lists the breaks per kind of block), and
inductor fuses the elementwise glue between the kernels. Blocks of one kind share their compiled code: parameters
are the graph's inputs, not constants, so a model of three kinds of block compiles three graphs per input shape.
The embedding, the head and the loss stay eager (the chunked linear + cross-entropy is one kernel already).

Compiled after activation checkpointing (its hooks are on the block module, which compiling leaves in place) and,
being a per-module wrapper, before a CUDA-graph capture of the whole step: the first call of each shape compiles
(tens of seconds on a GPU), which the capture's eager warm-up steps absorb.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module) -> int:
    """Compile every block of ``model.layers`` in place; returns how many. The model must have ``layers``."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} has no blocks to compile (no non-empty `layers` ModuleList)")
    # Dynamo keys a block's compiled code on the block's Python attributes (its mixer's type, its spec), so blocks
    # of several kinds, each at the training and validation shapes, with and without grad, are separate entries of
    # one code object (the Block's forward): the default limit of 8 would leave the rest eager. Room for each
    # layer to be its own kind in four modes.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(layers))
    for block in layers:
        block.compile()
    return len(layers)
