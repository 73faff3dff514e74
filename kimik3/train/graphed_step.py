"""The training step that ``kimik3 train --device cuda`` replays as one CUDA graph (issue 39).

Eagerly, a K3 step issues thousands of kernels from Python and the autograd engine, and on a GPU the host takes
longer to issue them than the GPU to run them. On one CUDA device and one process the Trainer's step (forward under
bf16 autocast, backward, gradient clipping, the optimizer step, the router balancer's bias update) is therefore one
function without host reads, ``GraphedTrainStep._step``, captured by ``CapturedStep`` for each batch shape and
replayed; the host reads the step's numbers (losses, gradient norm, balancer metrics) once, after the replay. A
process group (torchrun, ``--nproc``, even of one rank), multimodal batches (their image shapes vary) and
``--no-cuda-graph`` run the Trainer's eager step.

What capture asks for, and what it changes against the eager step:

- **Learning rates** live in 0-dim tensors on the device (the optimizer's ``group["lr"]``: AdamW is built
  capturable, Muon reads a tensor lr where it lies); the schedule writes them before each replay.
- **A non-finite step is skipped on the device**: when the loss or the gradient norm is not finite, the gradients
  are zeroed and the learning rates set to 0 for that step (inside the graph), and the router biases keep their
  values; the parameters do not move. AdamW's and Muon's moments still decay by one step (their gradient is
  zero), which the eager step's skip (no optimizer step at all) does not do.
- **Autocast without its weight-cast cache** (a capture cannot keep cached casts across replays): each forward
  casts the weights it uses, as the first forward of an eager step does.
- **One graph per batch shape**: a context-length stage that changes the shape warms up and captures again (three
  eager steps, then the capture: all real steps), and the previous shape's graph is dropped.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kimik3.model.k3 import check_token_ids
from kimik3.train import budget
from kimik3.train.captured_step import CapturedStep

# The step's numbers, in this order, ahead of the balancer's metrics.
NUMBERS = ("loss", "main_loss", "mtp_loss", "grad_norm", "finite")


class GraphedTrainStep:
    """``step(inputs, labels, lr_scale)`` -> (numbers by name, balancer metrics or {}): one training step of
    ``trainer``'s model at the learning rates ``base_lr * lr_scale``, replayed from a CUDA graph after its
    warm-up steps; ``train_step`` makes the Trainer's record of it. ``capture=False`` runs the same step eagerly
    (what the CPU tests check of it)."""

    def __init__(self, trainer: Any, capture: bool = True):
        self.trainer = trainer
        self.capture = capture
        device = trainer.device
        for group in trainer.optimizer.param_groups:
            group["lr"] = torch.full((), float(group["base_lr"]), dtype=torch.float32, device=device)
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.vocab = trainer.model_config.vocab_size
        self.shape: tuple[int, ...] | None = None
        self.captured: CapturedStep | None = None
        self.split_losses = False   # whether the model reports its main and MTP losses apart (set by the step)

    def train_step(self, step: int, total: int, shape: tuple[int, int], inputs: torch.Tensor, labels: torch.Tensor,
                   lr_scale: float) -> dict[str, Any]:
        """``Trainer.train_step``'s record of one step (one process: the losses are the global ones)."""
        trainer = self.trainer
        start = budget._now()
        numbers, balance = self(inputs, labels, lr_scale)
        elapsed = max(budget._now() - start, 1e-9)
        trainer.fwd_bwd_s = elapsed   # one graph: the budget's cost model takes the whole step as its compute
        finite = bool(numbers["finite"])
        if not finite:
            trainer.nonfinite_total += 1
        load = balance.get("load_max_over_mean_mean")
        return trainer.step_record(step, total, shape, lr_scale, elapsed, numbers["loss"], finite,
                                   numbers["grad_norm"] if finite else None,   # a skipped step: none, as eagerly
                                   (numbers["main_loss"], numbers["mtp_loss"]) if self.split_losses else None,
                                   load if load is not None and not math.isnan(load) else None)

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, lr_scale: float) -> tuple[dict[str, float], dict]:
        for group in self.trainer.optimizer.param_groups:
            group["lr"].fill_(group["base_lr"] * lr_scale)
        if not self.capture:
            numbers, metrics = self._step(inputs, labels)
        else:
            if tuple(inputs.shape) != self.shape:
                self.captured = None            # the previous shape's graph and its memory pool go
                torch.cuda.empty_cache()
                self.captured = CapturedStep(self._step, self.trainer.optimizer,
                                             check=lambda ids, targets: check_token_ids(ids, targets, self.vocab))
                self.shape = tuple(inputs.shape)
            numbers, metrics = self.captured(inputs, labels)
        values = numbers if metrics is None else torch.cat([numbers, metrics])
        host = values.tolist()                  # the step's one host read
        named = dict(zip(NUMBERS, host[:len(NUMBERS)], strict=True))
        balancer = self.trainer.balancer
        return named, (balancer.metrics_of(host[len(NUMBERS):]) if balancer is not None else {})

    def _step(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward, backward, clipping, the guarded optimizer and balancer steps, zero_grad: no host reads."""
        trainer = self.trainer
        with trainer._autocast(cache_enabled=False):
            out = trainer.model(inputs, labels=labels)
        if trainer.balancer is not None:
            trainer.balancer.observe(out.routing)   # bins the scores, then drops them before backward
        self.split_losses = out.main_loss is not None and out.mtp_loss is not None   # (a Python fact: constant)
        loss = out.loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, trainer.args.grad_clip, foreach=True)
        finite = torch.isfinite(loss.detach()) & torch.isfinite(norm)
        for p in self.params:
            if p.grad is not None:
                p.grad.masked_fill_(~finite, 0.0)
        for group in trainer.optimizer.param_groups:
            group["lr"].mul_(finite)
        trainer.optimizer.step()
        metrics = trainer.balancer.step_on_device(finite) if trainer.balancer is not None else None
        trainer.optimizer.zero_grad(set_to_none=True)
        nan = torch.full((), float("nan"), dtype=torch.float64, device=loss.device)
        main = out.main_loss.detach().double() if out.main_loss is not None else nan
        mtp = out.mtp_loss.detach().double() if out.mtp_loss is not None else nan
        numbers = torch.stack([loss.detach().double(), main, mtp, norm.double(), finite.double()])
        return numbers, metrics


__all__ = ["GraphedTrainStep", "NUMBERS"]
