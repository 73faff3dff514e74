"""The draft's training text written by its own target (``kimik3 train-draft --regenerate P``).

EAGLE-3 trains its draft on responses its target model regenerated, not on the corpus as written: a greedy serving
engine feeds the draft the target's own argmax tokens, so those are the inputs it should learn from. Here each
window of the corpus keeps its first P tokens and the target continues it greedily to the window's length (the
cached decode of ``K3ForCausalLM.generate``, many windows a call). The draft's soft targets are the target's
distributions either way; what changes is the tokens its chains are fed.

Legend: N windows, T tokens a window, P prompt tokens kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ROWS = 256   # windows continued together: one decode batch


@torch.no_grad()
def regenerate(model: nn.Module, windows_NT: torch.Tensor, prompt: int, rows: int = ROWS,
               advance: Callable[[int], None] | None = None) -> torch.Tensor:
    """``windows_NT`` [N, T] int64 (on any device) with positions P.. replaced by the target's greedy continuation of
    positions ..P-1: [N, T] int64, on the windows' device. ``advance(n)`` is told each time n more windows are done
    (a progress bar)."""
    if windows_NT.ndim != 2 or windows_NT.dtype != torch.int64:
        raise ValueError(f"windows must be a 2-D int64 tensor [N, T], got {windows_NT.dtype} "
                         f"{tuple(windows_NT.shape)}")
    length = windows_NT.shape[1]
    if isinstance(prompt, bool) or not isinstance(prompt, int) or not 1 <= prompt < length:
        raise ValueError(f"--regenerate keeps 1 to {length - 1} prompt tokens of {length}-token windows, got "
                         f"{prompt!r}")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    out = windows_NT.clone()
    device = next(model.parameters()).device
    for start in range(0, windows_NT.shape[0], rows):
        prompts = windows_NT[start:start + rows, :prompt].to(device)
        written = model.generate(prompts, length - prompt, temperature=0.0)   # no end token: the whole length
        out[start:start + prompts.shape[0]] = written.to(out.device)
        if advance is not None:
            advance(prompts.shape[0])
    return out


__all__ = ["ROWS", "regenerate"]
