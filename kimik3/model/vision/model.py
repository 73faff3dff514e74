"""The multimodal K3: the text model with the MoonViT-V2 tower and projector in front of its embedding.

Legend: B = batch, T = tokens, D = language model width, P = packed patches, I = image tokens.

A prompt holds, for each image, ``num_image_tokens(H, W)`` copies of the placeholder id
(``VisionConfig.image_token_id``; the chat form is ``<|media_begin|>`` + placeholders + ``<|media_end|>``,
``kimik3.tokenizer``). ``forward`` embeds the tokens, encodes the packed images (``pixel_values`` [P, 3·14·14],
``image_grid_hw`` [N, 2], images in the order their placeholders appear, row by row), and writes the i-th
image token's embedding over the i-th placeholder; the text stack then runs unchanged (``K3ForCausalLM``
with ``inputs_embeds``). Targets that are placeholders are ignored, so the loss is next-token prediction
on the text alone, and its gradient trains the tower end to end (from scratch, as the seed's K3 does).

State dict: the text model's keys unchanged, plus ``vision_tower.*`` and ``mm_projector.*``. The text
weights are initialised exactly as the text-only model's with the same seed (the tower is filled after).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from kimik3.config.schema import K3Config
from kimik3.model.k3 import IGNORE_INDEX, K3ForCausalLM, K3Output
from kimik3.model.norm import RMSNorm
from kimik3.model.vision.encoder import MoonViT
from kimik3.model.vision.projector import VisionProjector

VISION_MODULES = ("vision_tower", "mm_projector")


def image_token_id(config: K3Config) -> int:
    """The placeholder id of ``config``'s prompts (the vocabulary's last id unless the vision config names one)."""
    if config.vision is None:
        raise ValueError(f"config {config.name!r} has no vision tower")
    tid = config.vision.image_token_id
    return config.vocab_size - 1 if tid is None else tid


@contextmanager
def _without(model: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """Hide child modules for the duration (the text model's ``init_weights`` checks it saw every parameter)."""
    hidden = {name: model._modules.pop(name) for name in names}
    try:
        yield
    finally:
        model._modules.update(hidden)


@torch.no_grad()
def init_vision_weights(tower: MoonViT, projector: VisionProjector, generator: torch.Generator | None) -> None:
    """Linear weights and the position table: truncated normal (std ``init_std``, cut at 3 std); norms: ones."""
    std = tower.config.init_std
    done: set[int] = set()
    for module in (*tower.modules(), *projector.modules()):
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std, generator=generator)
            done.add(id(module.weight))
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
            done.add(id(module.weight))
    nn.init.trunc_normal_(tower.pos_embed, std=std, a=-3 * std, b=3 * std, generator=generator)
    done.add(id(tower.pos_embed))
    missed = [n for n, p in (*tower.named_parameters(), *projector.named_parameters()) if id(p) not in done]
    if missed:
        raise AssertionError(f"init_vision_weights left parameters uninitialised: {missed[:5]}")


class K3VLForCausalLM(K3ForCausalLM):
    """K3 with native vision: ``model(input_ids, labels, pixel_values=..., image_grid_hw=...)``.

    Without images it is the text model (same weights, same outputs). Built like it: on the meta device,
    then materialised and initialised once (``device="meta"`` stops before that)."""

    def __init__(self, config: K3Config, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, seed: int | None = None):
        if config.vision is None:
            raise ValueError(f"K3VLForCausalLM needs a config with a vision tower; {config.name!r} has none "
                             "(use K3ForCausalLM, or a *-vl preset)")
        super().__init__(config, device="meta")
        with torch.device("meta"):
            self.vision_tower = MoonViT(config.vision)
            self.mm_projector = VisionProjector(config.vision, config.dim)
        self.image_token_id = image_token_id(config)
        if not 0 <= self.image_token_id < config.vocab_size:
            raise ValueError(f"image token id {self.image_token_id} lies outside the vocabulary of {config.vocab_size}")
        self._materialise(device, dtype, seed)

    def _init_weights(self, generator: torch.Generator | None) -> None:
        """The text weights exactly as the text-only model's, then the tower's from the same generator."""
        with _without(self, VISION_MODULES):
            super()._init_weights(generator)
        init_vision_weights(self.vision_tower, self.mm_projector, generator)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_hw: torch.Tensor) -> torch.Tensor:
        """Packed images -> their LM-width embeddings [I, D], I = sum over images of rows·cols / merge²."""
        return self.mm_projector(self.vision_tower(pixel_values, image_grid_hw), image_grid_hw)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *args,
                pixel_values: torch.Tensor | None = None, image_grid_hw: torch.Tensor | None = None,
                **kwargs) -> K3Output:
        """As ``K3ForCausalLM.forward``, plus the images of the batch (see the module notes)."""
        if (pixel_values is None) != (image_grid_hw is None):
            raise ValueError("pass pixel_values and image_grid_hw together")
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        placeholders = input_ids == self.image_token_id
        count = int(placeholders.sum())
        embeds = self.embed(input_ids.clamp(0, self.config.vocab_size - 1))
        if pixel_values is not None:
            features = self.encode_images(pixel_values, image_grid_hw)
            if features.shape[0] != count:
                raise ValueError(f"the prompt has {count} image placeholders but the images give "
                                 f"{features.shape[0]} image tokens")
            embeds = embeds.masked_scatter(placeholders[..., None], features.to(embeds.dtype))
        elif count:
            raise ValueError(f"input_ids hold {count} image placeholders (id {self.image_token_id}) but no "
                             "pixel_values were given")
        if labels is not None and labels.shape == input_ids.shape:
            labels = labels.masked_fill(labels == self.image_token_id, IGNORE_INDEX)
        return super().forward(input_ids, labels, *args, inputs_embeds=embeds, **kwargs)


def causal_lm_class(config: K3Config) -> type[K3ForCausalLM]:
    """The model class for ``config``: ``K3VLForCausalLM`` when it has a vision tower, else ``K3ForCausalLM``."""
    return K3VLForCausalLM if config.vision is not None else K3ForCausalLM
