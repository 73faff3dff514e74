"""A fixed-shape training step captured once as a CUDA graph and replayed (issue 39).

Eagerly, one K3 training step issues ~5,000 kernels from Python and the autograd engine; on an H200 the host takes
longer to issue the debug model's step than the GPU takes to run it, and the GPU idles in between. Captured, the
whole step (forward, backward, optimizer step) is one graph launch.

    step = CapturedStep(train_step, optimizer, check=lambda ids, labels: check_token_ids(ids, labels, V))
    for ids, labels in batches:          # every call is one real step on its batch
        losses = step(ids, labels)       # warm-up calls run eagerly, then one capture, then replays

``train_step(*inputs)`` runs forward, backward, ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``
and returns tensors (the losses). What capture asks of it, and what this class checks:

- Same shapes, dtypes and devices on every call (the graph's buffers are fixed): a batch that differs is refused.
- No reads back to the host inside: the model skips its id check while capturing, so ``check`` runs on each batch
  before its replay instead (one read a step, after the previous replay is issued).
- Optimizer hyper-parameters are baked into the graph as the numbers they were at capture: a replay after any of
  them changed (a learning-rate schedule writing ``group["lr"]``) is refused rather than silently ignored.
  torch optimizers that keep their step count on the host (``capturable=False``) are refused up front.
- The returned tensors are the graph's own: the next call overwrites them (read or clone them first).

Warm-up calls (``warmup_steps``, 3 by default) run on a side stream, as capture requires (lazy optimizer state,
cuBLAS workspaces and Triton compiles happen there); they are real steps, like every call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kimik3.cuda_graph import warm_up
from kimik3.optim.multi import MultiOptimizer


def _members(optimizer) -> list[torch.optim.Optimizer]:
    if isinstance(optimizer, MultiOptimizer):
        return list(optimizer.optimizers.values())
    return [optimizer] if optimizer is not None else []


def _hyperparameters(optimizer) -> list[dict[str, Any]]:
    """Each param group's plain-number options (lr, betas, weight_decay, ...): what a capture bakes in."""
    groups = []
    for member in _members(optimizer):
        for group in member.param_groups:
            groups.append({key: value for key, value in group.items()
                           if isinstance(value, (int, float, bool)) or (isinstance(value, tuple) and all(
                               isinstance(v, (int, float)) for v in value))})
    return groups


def _signature(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    return [(tuple(t.shape), t.dtype, t.device) for t in tensors]


class CapturedStep:
    """``step(*inputs)``: ``train_step`` on these inputs, replayed from one CUDA graph after ``warmup_steps``
    eager calls (the module docstring says what capture asks of ``train_step``)."""

    def __init__(self, train_step: Callable[..., Any], optimizer=None, *, warmup_steps: int = 3,
                 check: Callable[..., None] | None = None):
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1 (capture needs a warmed-up step), got "
                             f"{warmup_steps!r}")
        for member in _members(optimizer):
            if "capturable" in member.defaults and not all(g.get("capturable") for g in member.param_groups):
                raise ValueError(f"{type(member).__name__} keeps its step count on the host: build it with "
                                 "capturable=True to capture it in a CUDA graph")
        self.train_step, self.optimizer, self.check = train_step, optimizer, check
        self.warmup_steps = warmup_steps
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._inputs: list[torch.Tensor] = []
        self._outputs: Any = None
        self._baked: list[dict[str, Any]] = []
        self._side = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if not inputs or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
            raise ValueError("CapturedStep takes CUDA tensors as its inputs, got "
                             + ", ".join(type(x).__name__ if not isinstance(x, torch.Tensor) else str(x.device)
                                         for x in inputs))
        if self.check is not None:
            self.check(*inputs)
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup_steps:
            return self._eager(inputs)
        if self.graph is None:
            self._capture(inputs)
        else:
            self._load(inputs)
        self.graph.replay()
        return self._outputs

    def _eager(self, inputs: Sequence[torch.Tensor]) -> Any:
        """A warm-up step on a side stream, ordered after and before the caller's work."""
        if self._side is None:
            self._side = torch.cuda.Stream(device=inputs[0].device)
        return warm_up(inputs[0].device, self._side, lambda: self.train_step(*inputs))

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        self._inputs = [x.detach().clone() for x in inputs]
        for member in _members(self.optimizer):
            member.zero_grad(set_to_none=True)
        torch.cuda.synchronize(inputs[0].device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._outputs = self.train_step(*self._inputs)
        self.graph = graph
        # The warm-up steps' activations sit cached in the regular pool; the graph has its own from now on.
        torch.cuda.empty_cache()
        self._baked = _hyperparameters(self.optimizer)

    def _load(self, inputs: Sequence[torch.Tensor]) -> None:
        if _signature(inputs) != _signature(self._inputs):
            raise ValueError(f"a captured step takes the inputs it was captured with: "
                             f"{_signature(self._inputs)}, got {_signature(inputs)}")
        now = _hyperparameters(self.optimizer)
        for index, (then, current) in enumerate(zip(self._baked, now, strict=True)):
            changed = sorted(k for k in then.keys() | current.keys() if then.get(k) != current.get(k))
            if changed:
                raise RuntimeError(f"optimizer param group {index} changed {changed} since the step was captured "
                                   f"({[then.get(k) for k in changed]} -> {[current.get(k) for k in changed]}); "
                                   "a captured step replays the values it was captured with")
        for static, x in zip(self._inputs, inputs, strict=True):
            static.copy_(x)
