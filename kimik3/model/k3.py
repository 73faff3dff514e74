"""The K3 stack: embedding -> hybrid layers (3 KDA : 1 Gated MLA, dense layer 0, LatentMoE after)
joined by Block AttnRes -> final mix -> RMSNorm -> head; optional MTP module.

Legend: B = batch, T = tokens, D = model width, V = vocabulary.

Build: parameters are created on the meta device and materialised once (``to_empty``) on the
target device, then filled by the single ``init_weights``. ``device="meta"`` stops before that,
so the full 2.78T configuration can be inspected without memory. Default dtype: bf16 on CUDA,
fp32 elsewhere; the router bias, A_log and dt_bias stay fp32 whatever the dtype.

Routing statistics: each call of the model (``model(...)``) opens a ``RoutingRecord`` before its
forward runs and closes it after every other forward hook, and the output carries what every
router saw (``K3Output.routing``). The record spans the call, not ``forward`` alone, so work that
a wrapper does around the forward is recorded too (context parallelism runs the MTP module in a
forward hook of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.config.schema import K3Config
from kimik3.model.attnres import AttnResMix
from kimik3.model.block import K3Block
from kimik3.model.cache import K3Cache
from kimik3.model.init import init_weights
from kimik3.model.moe import Router, RoutingRecord, RoutingStats
from kimik3.model.mtp import MTPModule
from kimik3.model.norm import RMSNorm
from kimik3.model.param_rules import ParamRule, adamw
from kimik3.model.pretrained import load_pretrained, save_pretrained
from kimik3.model.sampling import check_sampling, sample_next_token
from kimik3.ops.loss import linear_cross_entropy

IGNORE_INDEX = -100
FP32_PARAMS = ("A_log", "dt_bias")  # parameter names kept in fp32 under any model dtype


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 compute on GPU, fp32 on CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclass(slots=True)
class K3Output:
    # [B, T, V] (or [B, 1, V] with last_only / logits_at); None when labels are given: the loss then comes from
    # ``linear_cross_entropy`` over token chunks, and the [B, T, V] logits are never made (``model.head(
    # model.norm(out.hidden))`` gives them, or a second call without labels).
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None        # main CE + mtp.loss_weight * MTP CE, when labels are given
    main_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    hidden: torch.Tensor | None = None      # [B, T, D] final hidden state before the final norm
    # With ``features_at``: the stream after each of those layers, then ``hidden`` ([B, T, D] each; the
    # speculative draft's inputs, ``kimik3.model.draft``).
    features: list[torch.Tensor] | None = None
    # One entry per router of ``K3ForCausalLM.routers()`` (the layers' in order, then the MTP
    # module's): what it saw in this call, None for a router that did not run (the MTP module's
    # without labels). Filled by calling the model; ``forward`` called directly leaves it empty.
    routing: tuple[RoutingStats | None, ...] = ()


def check_token_ids(input_ids: torch.Tensor, labels: torch.Tensor | None, vocab_size: int) -> None:
    """Raise ValueError unless every id lies in [0, vocab_size) and every label there or at IGNORE_INDEX.

    One read back to the host for both (a sync on CUDA). None while a CUDA graph is being captured: its replays
    run no Python, so whoever replays it checks each batch (the serving engine as requests arrive,
    ``kimik3.train.captured_step.CapturedStep`` before each step)."""
    if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    stats = []
    if input_ids.numel():
        stats += [input_ids.min(), input_ids.max()]
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size)) if labels is not None else None
    if bad is not None and bad.numel():
        stats.append(bad.sum())
    if not stats:
        return
    values = torch.stack([x.long() for x in stats]).tolist()
    if input_ids.numel() and (values[0] < 0 or values[1] >= vocab_size):
        raise ValueError(f"input_ids must lie in [0, {vocab_size}), got [{values[0]}, {values[1]}]")
    if bad is not None and bad.numel() and values[-1]:
        raise ValueError(f"labels must lie in [0, {vocab_size}) or equal {IGNORE_INDEX} (ignored), got "
                         f"{int(labels[bad][0])} ({values[-1]} out of range)")


class K3ForCausalLM(nn.Module):
    """Kimi K3 causal language model.

    ``model(input_ids)`` -> ``K3Output`` with ``.logits`` [B, T, vocab]. With ``labels`` (already
    shifted: ``labels[t]`` is the target of position t, -100 ignored) it returns the loss instead, and no logits.
    With a ``K3Cache`` it continues the cached sequences (prefill, chunked prefill or decode).
    """

    def __init__(self, config: K3Config, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, seed: int | None = None):
        super().__init__()
        self.config = config
        self._routers: tuple[Router, ...] | None = None
        self._open_records: list[RoutingRecord] = []
        self.register_forward_pre_hook(_open_routing_record)
        self._close_record_hook = self.register_forward_hook(_close_routing_record, always_call=True).id
        with torch.device("meta"):
            self.embed = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(
                K3Block(config, spec, config.attn_res.enabled) for spec in config.layer_plan())
            self.final_mix = AttnResMix(config.dim, config.norm_eps) if config.attn_res.enabled else None
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.lm_head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
            self.mtp = MTPModule(config) if config.mtp.num_modules else None
        self._materialise(device, dtype, seed)

    def _materialise(self, device: torch.device | str | None, dtype: torch.dtype | None, seed: int | None) -> None:
        """Allocate the meta-built parameters on ``device`` (nothing on the meta device), cast them and initialise
        them with ``seed``'s generator (``_init_weights``)."""
        device = torch.device(device if device is not None else "cpu")
        if device.type == "meta":
            return
        self.to_empty(device=device)
        self.cast(dtype or default_dtype(device))
        self._init_weights(torch.Generator(device=device).manual_seed(seed) if seed is not None else None)

    def _init_weights(self, generator: torch.Generator | None) -> None:
        init_weights(self, self.config, generator)

    # ------------------------------------------------------------------ bookkeeping
    def cast(self, dtype: torch.dtype) -> "K3ForCausalLM":
        """Cast parameters to ``dtype``, keeping the router bias and the KDA decay params fp32."""
        for name, param in self.named_parameters():
            keep = name.rsplit(".", 1)[-1] in FP32_PARAMS
            param.data = param.data.to(torch.float32 if keep else dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def routers(self) -> list[Router]:
        """Every MoE router, in layer order, the MTP module's last (it trains, so it is balanced too)."""
        if self._routers is None:
            self._routers = tuple(m for m in self.modules() if isinstance(m, Router))
        return list(self._routers)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output head's weight [V, D]: the embedding's when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight)

    # ------------------------------------------------------------------ forward
    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        # The output head maps to vocabulary logits, not hidden features: AdamW like the embedding.
        return [("lm_head.weight", adamw(True, "K3ForCausalLM.lm_head"))] if self.lm_head is not None else []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cache: K3Cache | None = None, cu_seqlens: torch.Tensor | None = None,
                last_only: bool = False, logits_at: torch.Tensor | None = None,
                features_at: tuple[int, ...] = (), inputs_embeds: torch.Tensor | None = None) -> K3Output:
        """input_ids [B, T] int64; cu_seqlens [N+1] for packed sequences (B must be 1). ``last_only``: logits of
        the last position only ([B, 1, V]); ``logits_at``: of position ``logits_at[b]`` of each row instead (a
        device tensor [B]: a padded chunk's last real token, chosen without a host read).

        labels [B, T] (shifted, -100 ignored): the output has the losses (main, MTP's, their weighted sum) and
        ``logits`` None: the head and the cross-entropy run fused over token chunks (``linear_cross_entropy``),
        without the [B, T, V] fp32 logits. ``features_at``: layer indices whose output stream ``K3Output.features``
        returns, followed by the final hidden state. ``inputs_embeds`` [B, T, D]: the embedded input to use instead
        of ``embed(input_ids)`` (the multimodal model's, with image features over the placeholders)."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if labels is not None:
            if last_only or logits_at is not None:
                raise ValueError("labels need every position: drop last_only / logits_at")
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids "
                                 f"{tuple(input_ids.shape)}")
        check_token_ids(input_ids, labels, self.config.vocab_size)
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError("cu_seqlens packs sequences along T: input_ids must have batch size 1")
            if cache is not None:
                raise ValueError("cu_seqlens cannot be combined with a cache")
        if cache is not None and len(cache.layers) != len(self.layers):
            raise ValueError(f"cache has {len(cache.layers)} layer states, the model {len(self.layers)} layers")

        if inputs_embeds is not None and inputs_embeds.shape != (*input_ids.shape, self.config.dim):
            raise ValueError(f"inputs_embeds must be [batch, tokens, {self.config.dim}] like input_ids, got "
                             f"{tuple(inputs_embeds.shape)}")
        stream = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        entries: list[torch.Tensor] = []
        features = []
        for index, block in enumerate(self.layers):
            state = cache.layers[index] if cache is not None else None
            stream, entries = block(stream, entries, state, cu_seqlens)
            if index in features_at:
                features.append(stream)
        if len(features) != len(features_at) or list(features_at) != sorted(set(features_at)):
            raise ValueError(f"features_at {features_at}: layer indices must be increasing and below "
                             f"{len(self.layers)}")
        hidden = self.final_mix(entries + [stream]) if self.final_mix is not None else stream
        if cache is not None:
            cache.seq_len += input_ids.shape[1]

        out = K3Output(hidden=hidden, features=features + [hidden] if features_at else None)
        if labels is None:
            if logits_at is not None:
                picked = hidden.gather(1, logits_at.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))
            else:
                picked = hidden[:, -1:] if last_only else hidden
            out.logits = self.head(self.norm(picked))
        else:
            out.main_loss = linear_cross_entropy(self.norm(hidden), self.head_weight, labels,
                                                 ignore_index=IGNORE_INDEX, check_labels=False)
            out.loss = out.main_loss
            if self.mtp is not None and input_ids.shape[1] > 1:
                out.mtp_loss = self._mtp_loss(hidden, labels, cu_seqlens)
                out.loss = out.main_loss + self.config.mtp.loss_weight * out.mtp_loss
        return out

    def _mtp_loss(self, hidden: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        # Position t sees h_t and x_{t+1} (= labels[t]) and predicts x_{t+2} (= labels[t+1]).
        length = hidden.shape[1] - 1
        known = labels[:, :length]
        targets = labels[:, 1:].masked_fill(known == IGNORE_INDEX, IGNORE_INDEX)
        cu = cu_seqlens.clamp(max=length) if cu_seqlens is not None else None
        mtp_hidden = self.mtp(hidden[:, :length], self.embed(known.clamp(min=0)), cu)
        return linear_cross_entropy(mtp_hidden, self.head_weight, targets, ignore_index=IGNORE_INDEX,
                                    check_labels=False)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, eos_token_id: int | None = None,
                 generator: torch.Generator | None = None,
                 on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Decode with the hybrid cache: one prefill, then one token per step.

        input_ids [B, T] (all prompts the same length). Returns [B, T + n] with n <= max_new_tokens
        (fewer when every row has produced ``eos_token_id``). ``on_token`` receives each new [B]
        column as it is produced (streaming).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_sampling(temperature, top_p, top_k)  # before the prefill, not at the first sampled token
        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [batch, tokens>=1], got shape {tuple(input_ids.shape)}")
        batch, prompt_len = input_ids.shape
        total = prompt_len + max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        was_training = self.training
        self.eval()
        try:
            return self._decode(input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator,
                                on_token)
        finally:  # also when a forward refuses (a context-parallel model takes no cache)
            self.train(was_training)

    def _decode(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, generator, on_token):
        batch, prompt_len = input_ids.shape
        cache = K3Cache.allocate(self.config, batch, prompt_len + max_new_tokens, device=self.device,
                                 dtype=self.dtype)
        logits = self(input_ids, cache=cache, last_only=True).logits[:, -1]
        tokens = [input_ids]
        finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            next_B = sample_next_token(logits, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                next_B = next_B.masked_fill(finished, eos_token_id)
                finished |= next_B == eos_token_id
            tokens.append(next_B[:, None])
            if on_token is not None:
                on_token(next_B)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            logits = self(next_B[:, None], cache=cache).logits[:, -1]
        return torch.cat(tokens, dim=1)

    # ------------------------------------------------------------------ files
    def save_pretrained(self, directory: str | Path, *, layout: str = "kimik3",
                        max_shard_bytes: int | None = None, pack_experts: bool = False) -> None:
        """Write ``config.json`` and the weights into ``directory`` (atomically): our layout, or "hf" (the
        released checkpoint's names, an HF config, sharded); ``pack_experts``: quantisation-aware experts as
        MXFP4 codes + scales (``kimik3.quant.packed``); see ``kimik3.model.pretrained``."""
        save_pretrained(self, directory, layout=layout, max_shard_bytes=max_shard_bytes, pack_experts=pack_experts)

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> "K3ForCausalLM":
        """Read a directory written by ``save_pretrained`` in either layout, or a released-layout (HF) checkpoint
        (never uses pickle); the dtype defaults to ``default_dtype(device)`` (device default: CPU)."""
        device = torch.device(device if device is not None else "cpu")
        return load_pretrained(cls, directory, device=device, dtype=dtype or default_dtype(device))


def _open_routing_record(model: K3ForCausalLM, args: Any) -> None:
    # Hooks added after construction (context parallelism's, FSDP's) run after this model's own
    # unless it moves to the end: the record must also see the routers they call.
    model._forward_hooks.move_to_end(model._close_record_hook)
    record = RoutingRecord()
    record.__enter__()
    model._open_records.append(record)


def _close_routing_record(model: K3ForCausalLM, args: Any, output: Any) -> None:
    if not model._open_records:   # an earlier pre-forward hook raised before the record opened
        return
    record = model._open_records.pop()
    record.__exit__(None, None, None)
    if isinstance(output, K3Output):
        output.routing = record.stats(model.routers())

