"""Images inside the engine: where each image's placeholders lie, the prefix cache's keys for them, and the image
embeddings a prefill chunk writes over its placeholders.

**Spans.** A request carries its images (``GenerationRequest.images``, in prompt order) and a prompt holding, for
the i-th image, ``images[i].num_tokens`` consecutive placeholder ids (``ImageRule.image_token_id``; the chat
template puts ``<|media_begin|>`` and ``<|media_end|>`` around them). ``media_spans`` finds them and refuses a
prompt whose placeholders do not match its images (a count off, an image's placeholders not contiguous).

**Cache keys.** Every image's placeholders are the same token id, so token ids alone would let a request with a
different image restore a checkpoint computed over another image. ``MediaTokens`` is the sequence's token list
(a ``list`` of the same ids, so everything that reads tokens is unchanged) that also knows its spans; the prefix
cache's ``BlockHasher`` folds ``block_key(i)`` into the hash of block i: for each image whose placeholders
overlap the block, its digest (sha256 of its pixels and tokenising rule) and the index, within the image, of the
block's first placeholder of it. Hashes are chained, so every block from an image's first one on names the
image's content, while the blocks before it (a shared system prompt) still match across different images -- as
vLLM and SGLang key multimodal prefixes. A token list without images hashes exactly as before.

**Embeddings.** At prefill the model runner asks ``ImageEmbedder`` for the chunk's input embeddings: the token
embeddings with, over each placeholder the chunk holds, its image's embedding (``K3VLForCausalLM.encode_images``).
An image is encoded once per request, alone (so its features never depend on which other images share a batch),
when the first chunk that holds one of its placeholders runs; a chunk boundary inside the span takes the slice it
needs from those features, which are dropped once the prefill has passed the span. Placeholders restored from
the prefix cache are never encoded. Decode and the CUDA graphs see token ids only: images enter at prefill.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from kimik3.serve.images import PreparedImage


@dataclass(frozen=True, slots=True)
class MediaSpan:
    start: int          # position of the image's first placeholder
    length: int         # its placeholders (the image's tokens)
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.length


def media_spans(prompt_ids: Seq[int], images: Seq[PreparedImage], image_token_id: int) -> tuple[MediaSpan, ...]:
    """Each image's placeholder span in ``prompt_ids`` (images in prompt order); ValueError when they disagree."""
    positions = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    expected = sum(image.num_tokens for image in images)
    if len(positions) != expected:
        raise ValueError(f"the prompt holds {len(positions)} image placeholders (token {image_token_id}) but its "
                         f"{len(images)} image(s) take {expected}")
    spans, at = [], 0
    for i, image in enumerate(images):
        start = positions[at]
        if positions[at + image.num_tokens - 1] != start + image.num_tokens - 1:
            raise ValueError(f"image {i}'s {image.num_tokens} placeholders are not consecutive in the prompt")
        spans.append(MediaSpan(start, image.num_tokens, image.digest))
        at += image.num_tokens
    return tuple(spans)


class MediaTokens(list):
    """A sequence's token ids (a plain ``list`` of ints) and the spans of its images, for the prefix cache's keys.

    Appending keeps the spans; a prefix slice ``tokens[:n]`` keeps those it still holds; any other slice or copy
    is a plain list (nothing hashes those)."""

    __slots__ = ("spans", "_starts")

    def __init__(self, ids: Seq[int], spans: Seq[MediaSpan]) -> None:
        super().__init__(ids)
        self.spans = tuple(sorted(spans, key=lambda s: s.start))
        self._starts = [s.start for s in self.spans]

    def __getitem__(self, index):
        out = super().__getitem__(index)
        if isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1):
            return MediaTokens(out, [s for s in self.spans if s.end <= len(out)]
                               + [MediaSpan(s.start, len(out) - s.start, s.digest) for s in self.spans
                                  if s.start < len(out) < s.end])
        return out

    def block_key(self, index: int, block: int) -> bytes:
        """The bytes folded into the hash of block ``index`` (tokens ``[index·block, (index+1)·block)``): for each
        image overlapping it, its digest and the index within the image of the block's first placeholder of it."""
        lo, hi = index * block, (index + 1) * block
        key = b""
        for s in self.spans[:bisect_right(self._starts, hi - 1)]:
            if s.end > lo:
                key += s.digest + (max(lo, s.start) - s.start).to_bytes(8, "little")
        return key


class ImageEmbedder:
    """One request's image embeddings for its prefill chunks (see the module notes)."""

    def __init__(self, images: Seq[PreparedImage], spans: Seq[MediaSpan]) -> None:
        self.images, self.spans = list(images), list(spans)
        self.features: dict[int, torch.Tensor] = {}     # image index -> [tokens, D], while the prefill needs it
        self.encoded = 0                                  # images encoded so far (each once)

    def touches(self, start: int, end: int) -> bool:
        return any(s.start < end and s.end > start for s in self.spans)

    def embeds(self, model: torch.nn.Module, ids_1T: torch.Tensor, start: int) -> torch.Tensor:
        """``model.embed(ids)`` [1, T, D] of the chunk at ``start`` with its placeholders' image embeddings."""
        end = start + ids_1T.shape[1]
        embeds = model.embed(ids_1T)
        for i, span in enumerate(self.spans):
            if span.start >= end or span.end <= start:
                continue
            features = self.features.get(i)
            if features is None:
                image = self.images[i]
                grid = torch.tensor([image.grid], dtype=torch.long, device=ids_1T.device)
                features = model.encode_images(image.pixel_values.to(ids_1T.device), grid)
                if features.shape[0] != span.length:
                    raise ValueError(f"image {i} encodes to {features.shape[0]} tokens, its prompt has {span.length}")
                self.features[i] = features
                self.encoded += 1
            a, b = max(start, span.start), min(end, span.end)
            embeds[0, a - start:b - start] = features[a - span.start:b - span.start].to(embeds.dtype)
            if b == span.end:
                del self.features[i]   # the prefill has passed this image
        return embeds
