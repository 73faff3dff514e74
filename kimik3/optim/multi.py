"""Several optimizers driven as one (K3: per-head Muon on matrices, AdamW on the rest)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class MultiOptimizer:
    """Several optimizers (K3: ``muon`` and ``adamw``) driven as one.

    ``param_groups`` is the concatenation of the members' groups (the same dict objects, so a
    scheduler writing ``group["lr"]`` reaches the real optimizer); every group carries a
    ``"name"`` and a ``"base_lr"`` (its lr at build time; schedulers set lr = base_lr * factor).
    ``state_dict()`` is ``{member name: member.state_dict()}``.

    Note: torch.optim.lr_scheduler classes insist on a torch Optimizer instance; drive this
    object by writing ``group["lr"]`` directly, or give each member its own scheduler.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("MultiOptimizer: optimizers must name at least one optimizer")
        for key, opt in optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(f"MultiOptimizer: optimizers[{key!r}] is a {type(opt).__name__}, "
                                 "not a torch.optim.Optimizer")
        self.optimizers = dict(optimizers)
        for key, opt in self.optimizers.items():
            for index, group in enumerate(opt.param_groups):
                group.setdefault("name", f"{key}.{index}")
                group.setdefault("base_lr", group["lr"])

    def __getitem__(self, key: str) -> torch.optim.Optimizer:
        return self.optimizers[key]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per-parameter state of all members (parameters are disjoint across members)."""
        merged: dict[torch.Tensor, dict[str, Any]] = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Evaluate ``closure`` once (if given), then step every member."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {key: opt.state_dict() for key, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(f"MultiOptimizer.load_state_dict: state_dict has members {sorted(state_dict)}, "
                             f"this optimizer has {sorted(self.optimizers)}")
        for key, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[key])

    def __repr__(self) -> str:
        groups = ", ".join(f"{g['name']}({len(g['params'])})" for g in self.param_groups)
        return f"MultiOptimizer({groups})"
