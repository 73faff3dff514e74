"""How each parameter of the model is optimised, declared by the module that owns it.

K3 trains matrices with per-head Muon (each attention head's and each expert's block
orthogonalised on its own) and everything else with AdamW. Only the module knows its weights'
layout (which axis is head-major, where the experts are stacked), so each module declares, through
``optimizer_rules()``, a ``ParamRule`` per parameter; ``kimik3.optim.classify_parameters`` reads
them and needs to know no model class. A module that declares nothing falls under the generic
rules there (any ``nn.Linear`` weight: whole-matrix Muon; any other 1-D parameter: AdamW without
decay).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamRule:
    """Where one parameter goes.

    optimizer: "muon" or "adamw"; split: the Muon split (None for AdamW): ``("whole",)``,
    ``("rows", H)`` / ``("cols", H)`` for head-major output / input features, ``("experts",)``
    for stacked experts; decay: whether the group applies weight decay; source: the rule that
    claimed it (for error messages and printing the table).
    """

    optimizer: str
    split: tuple | None
    decay: bool
    source: str


def muon(split: tuple, source: str) -> ParamRule:
    return ParamRule("muon", split, True, source)


def adamw(decay: bool, source: str) -> ParamRule:
    return ParamRule("adamw", None, decay, source)
