"""The speculative-decoding draft: K3's MTP module grown into an EAGLE-3-style draft (seed section 8).

Legend: B = batch, T = tokens, D = model width.

The draft predicts the token after next from what the target model already computed. Its first step at position t
reads a *fusion* of three of the target's hidden features at t (the output stream of a low and a middle layer, and
the final hidden state) plus the embedding of the token x_{t+1}:

    g_t = fuse([f_low; f_mid; f_high])                       (3D -> D)
    a_t, n_t = MTPModule.step(g_t, emb(x_{t+1}))              (the block's output, its normalised form)
    q(x_{t+2}) = softmax(head(n_t))                           (the target's own output head)

Each later step k feeds the draft its own previous output a instead of g, with the embedding of the token it just
drafted: a chain of K steps proposes K tokens from one set of target features. The block's MLA layer keeps its own
latent cache over the positions it has seen (K3's MLA layers use no positional encoding, so a latent's slot is
all that says where it is).

``EagleDraft.from_mtp`` starts from a trained MTP module with ``fuse`` = [0 | 0 | I]: the first step is then
exactly the MTP module (which was trained on the final hidden state), and draft training
(``kimik3.train.draft``) takes it from there. The embedding stays the target's (frozen, not stored with the draft);
so does the head, unless the draft has a reduced vocabulary.

**Reduced vocabulary** (EAGLE-3's): a draft given ``vocab_ids`` (N target token ids, e.g. the N most frequent in
its training data) has a head of its own over those ids, initialised from the target head's rows and trained with
the draft. A drafted token costs an N-row head instead of the target's V rows (at K3's width and V = 163,840 the
target head is 2.35 GB of bf16 read per drafted token); the draft proposes only those ids, which keeps the
verification lossless (any proposal distribution does; a sampled row's q is zero outside them).

Files: ``draft.safetensors`` (the draft's own weights) and ``draft.json`` (its feature layers, the loss it was
trained with, a summary of training) in the run directory.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kimik3.config.schema import K3Config
from kimik3.files import atomic_write, write_text_atomic
from kimik3.model.cache import LatentCache
from kimik3.model.mtp import MTPModule

DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_META = "draft.json"


def default_feature_layers(config: K3Config) -> tuple[int, int]:
    """The low and the middle layer whose output streams the draft reads (EAGLE-3 reads an early, a middle and a
    late layer; the late one here is the final hidden state)."""
    layers = config.num_layers
    low = 1 if layers > 2 else 0
    return low, max(low + 1, layers // 2) if layers > 1 else low


class EagleDraft(nn.Module):
    def __init__(self, config: K3Config, feature_layers: tuple[int, ...] | None = None,
                 layer: MTPModule | None = None, vocab: int | None = None):
        super().__init__()
        self.config = config
        self.feature_layers = tuple(feature_layers if feature_layers is not None else default_feature_layers(config))
        if list(self.feature_layers) != sorted(set(self.feature_layers)) or not all(
                0 <= i < config.num_layers for i in self.feature_layers):
            raise ValueError(f"feature_layers {self.feature_layers}: increasing layer indices below "
                             f"{config.num_layers} expected")
        width = (len(self.feature_layers) + 1) * config.dim
        self.fuse = nn.Linear(width, config.dim, bias=False)
        self.layer = layer if layer is not None else MTPModule(config)
        if vocab is not None and not 1 <= vocab <= config.vocab_size:
            raise ValueError(f"a draft vocabulary of {vocab} ids: 1 to the model's {config.vocab_size} expected")
        # The reduced vocabulary: its target ids (ascending) and the head over them; None: the target's head.
        self.register_buffer("vocab_ids", None if vocab is None else torch.zeros(vocab, dtype=torch.long))
        self.head = None if vocab is None else nn.Linear(config.dim, vocab, bias=False)

    @classmethod
    def from_mtp(cls, model: nn.Module, feature_layers: tuple[int, ...] | None = None,
                 vocab_ids: torch.Tensor | None = None) -> "EagleDraft":
        """A draft initialised from ``model``'s MTP module (which it must have), in the model's dtype and device;
        ``fuse`` passes the final hidden state through, so the first step equals the MTP module. ``vocab_ids``:
        a reduced vocabulary (distinct target ids), its head initialised from the target head's rows."""
        if getattr(model, "mtp", None) is None:
            raise ValueError("the model has no MTP module (mtp.num_modules = 0): there is nothing to grow a draft "
                             "from; train with the MTP module on")
        weight = model.head_weight
        ids = None if vocab_ids is None else check_vocab_ids(vocab_ids, model.config.vocab_size).to(weight.device)
        draft = cls(model.config, feature_layers, layer=copy.deepcopy(model.mtp),   # the MTP module's dtypes too
                    vocab=None if ids is None else len(ids))
        draft.fuse.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            dim = model.config.dim
            draft.fuse.weight.zero_()
            draft.fuse.weight[:, -dim:] = torch.eye(dim, dtype=weight.dtype, device=weight.device)
            if ids is not None:
                draft.vocab_ids = ids.clone()
                draft.head.to(device=weight.device, dtype=weight.dtype)
                draft.head.weight.copy_(weight[ids])
        return draft

    def logits(self, model: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        """The draft's logits of a step's normalised output: [..., V] through the target's head, or [..., N] over
        the reduced vocabulary (index i is target id ``vocab_ids[i]``: ``target_ids``)."""
        return model.head(normed) if self.head is None else self.head(normed)

    def target_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into ``logits``' last axis -> target token ids."""
        return index if self.vocab_ids is None else self.vocab_ids[index]

    def fuse_features(self, features: list[torch.Tensor]) -> torch.Tensor:
        """The target's features at some positions (``K3Output.features`` from ``features_at=feature_layers``:
        each [B, T, D]) -> the first step's input g [B, T, D]."""
        if len(features) != len(self.feature_layers) + 1:
            raise ValueError(f"the draft fuses {len(self.feature_layers) + 1} features (layers "
                             f"{self.feature_layers} and the final hidden state), got {len(features)}")
        return self.fuse(torch.cat(features, dim=-1))

    def forward(self, feature_BTD: torch.Tensor, token_embed_BTD: torch.Tensor,
                state: LatentCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (the next step's feature a [B, T, D], the normalised output for the target's head).
        ``feature_BTD``: g from ``fuse_features`` or the previous step's a; ``token_embed_BTD``: the target's
        embedding of the token after each position; ``state``: the block's MLA cache (None: causal over T)."""
        return self.layer.step(feature_BTD, token_embed_BTD, state)

    # ------------------------------------------------------------------ files
    def save(self, run_dir: str | Path, meta: dict[str, Any] | None = None) -> None:
        """Write ``draft.safetensors`` and ``draft.json`` into the run directory (each atomically)."""
        run = Path(run_dir)
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        atomic_write(run / DRAFT_WEIGHTS, lambda tmp: save_file(tensors, str(tmp)))
        record = {"feature_layers": list(self.feature_layers),
                  "vocab": None if self.vocab_ids is None else len(self.vocab_ids), **(meta or {})}
        write_text_atomic(run / DRAFT_META, json.dumps(record, indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: str | Path, model: nn.Module) -> "EagleDraft":
        """The draft saved in ``run_dir`` for the target ``model`` (its config, dtype and device)."""
        run = Path(run_dir)
        for name in (DRAFT_WEIGHTS, DRAFT_META):
            if not (run / name).is_file():
                raise FileNotFoundError(f"{run / name} is missing: train a draft first (`kimik3 train-draft --run "
                                        f"{run}`)")
        meta = json.loads((run / DRAFT_META).read_text())
        layers = meta.get("feature_layers")
        if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
            raise ValueError(f"{run / DRAFT_META}: 'feature_layers' must be a list of layer indices, got {layers!r}")
        vocab = meta.get("vocab")
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)
                                  or not 1 <= vocab <= model.config.vocab_size):
            raise ValueError(f"{run / DRAFT_META}: 'vocab' must be null or 1 to {model.config.vocab_size} ids, got "
                             f"{vocab!r}")
        # The shapes, dtypes and device; the values come from the file.
        draft = cls.from_mtp(model, tuple(layers), None if vocab is None else torch.arange(vocab))
        tensors = load_file(str(run / DRAFT_WEIGHTS), device=str(model.head_weight.device))
        expected = draft.state_dict()
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        if missing or extra:
            raise ValueError(f"{run / DRAFT_WEIGHTS}: does not match the model's draft: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        for name, ref in expected.items():
            if tuple(tensors[name].shape) != tuple(ref.shape):
                raise ValueError(f"{run / DRAFT_WEIGHTS}: {name!r} has shape {tuple(tensors[name].shape)}, the "
                                 f"model's draft needs {tuple(ref.shape)}")
        if vocab is not None:
            check_vocab_ids(tensors["vocab_ids"], model.config.vocab_size, f"{run / DRAFT_WEIGHTS}: ")
        draft.load_state_dict(tensors)   # copies into the draft's tensors, keeping their dtypes
        return draft


def check_vocab_ids(ids: torch.Tensor, vocab_size: int, where: str = "") -> torch.Tensor:
    """``ids`` as a draft vocabulary: a 1-D integer tensor of distinct ids in 0..vocab_size-1, ascending (else
    ValueError, prefixed by ``where``); returned as int64."""
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{where}a draft vocabulary is a non-empty 1-D tensor of integer ids, got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{where}draft vocabulary ids must lie in 0..{vocab_size - 1}, got {int(ids.min())}.."
                         f"{int(ids.max())}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{where}draft vocabulary ids must be distinct and ascending")
    return ids
