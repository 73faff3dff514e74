"""RL rollouts on the serving engine, and the policy's weights synchronised into it.

**The engine's model.** The ``LLMEngine`` cannot serve the trained module itself: its model runner packs each
layer's projection weights into one buffer (``pack_projections``) and, under QAT, replaces the routed experts'
full-precision parameters by MXFP4 codes + scales (``pack_mxfp4``), after which the module cannot train. So the
engine holds a model of its own (``RolloutEngine``), built once with the policy's config and device, in the dtype
the policy computes in (``rollout_dtype``: bf16 on CUDA, where the policy trains under bf16 autocast).

**Synchronisation** (``RolloutEngine.sync``, once per iteration, before the rollouts): every parameter and buffer
of the policy is copied in place into the engine's model (``load_state_dict`` copies into the existing tensors,
so the packed layout and the addresses that CUDA graphs read stay valid); quantised experts are re-quantised from
the policy's weights into their existing codes and scales (the values the policy's fake-quantised forward uses:
QAT is on in rollouts as in updates). Then the prefix cache is cleared: its KDA checkpoints and MLA latents were
computed by the previous weights. The copy happens under the engine's lock, with no request in flight. (The
engine has no public API for this yet; ``kimik3/serve`` was read-only for this work, so ``sync`` reaches its
``_lock`` and ``core`` directly.)

**Rollouts** (``RolloutEngine.rollouts``): ``generate_completions`` (``evaluate.py``) with log-probabilities
asked for: every (prompt, sample) at once, continuous batching; of the G samples of a prompt the first computes
it and the others restore it from the prefix cache. The log-probabilities are those of the distribution each
token was drawn from (the engine's "processed" log-probabilities: log-softmax of the logits over the
temperature).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kimik3.posttrain.evaluate import Rollout, generate_completions
from kimik3.posttrain.tasks import Task
from kimik3.serve.chat import ChatEncoder


@dataclass(slots=True)
class RolloutStats:
    seconds: float
    completion_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(self.seconds, 1e-9)


def rollout_dtype(parameter: torch.Tensor) -> torch.dtype:
    """The dtype of the engine's model for a policy whose parameters look like ``parameter``: bf16 on CUDA, where
    the policy trains in fp32 under bf16 autocast (its matmuls already see bf16 weights) and where the engine's
    captured graphs need the bf16 MoE path (the fp32 grouped matmul loops over experts with a host read); the
    policy's own dtype elsewhere (the CPU computes in fp32)."""
    return torch.bfloat16 if parameter.is_cuda and parameter.dtype == torch.float32 else parameter.dtype


class RolloutEngine:
    """An ``LLMEngine`` on a model of its own, kept equal to the policy's weights by ``sync``."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, encoder: ChatEncoder, max_running: int = 64,
                 max_waiting: int = 4096):
        from kimik3.model.k3 import K3ForCausalLM
        from kimik3.serve.engine import LLMEngine
        from kimik3.serve.memory import EngineConfig
        from kimik3.tokenizer import EOS

        first = next(policy.parameters())
        self.model = K3ForCausalLM(policy.config, device=first.device, dtype=rollout_dtype(first))
        self.model.load_state_dict(policy.state_dict())
        self.engine = LLMEngine(self.model, tokenizer, EngineConfig(max_running=max_running, max_waiting=max_waiting),
                                model_name="rl-policy", eos_token_id=tokenizer.token_to_id(EOS))
        self.encoder = encoder
        self.tokenizer = tokenizer

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """Copy ``policy``'s weights into the engine's model, in place, and drop the prefix cache."""
        from kimik3.quant.kernel_order import to_order
        from kimik3.quant.mx import quantize

        engine = self.engine
        with engine._lock:
            core = engine.core
            if core is None or core.has_work():
                raise RuntimeError("the rollout engine has requests in flight (or no core): weights cannot change")
            state = policy.state_dict()
            quantised = {name: module for name, module in self.model.named_modules()
                         if getattr(module, "packed", None) is not None}
            packed_keys = {f"{name}.{w}" if name else w for name, module in quantised.items()
                           for w in module.EXPERT_WEIGHTS}
            missing, unexpected = self.model.load_state_dict({k: v for k, v in state.items() if k not in packed_keys},
                                                             strict=False)
            absent = sorted(set(missing) - packed_keys)
            if absent or unexpected:
                raise RuntimeError(f"the policy and the engine's model differ: missing {absent}, unexpected "
                                   f"{sorted(unexpected)}")
            for name, module in quantised.items():
                for weight in module.EXPERT_WEIGHTS:
                    held = module.packed[weight]
                    fresh = to_order(quantize(state[f"{name}.{weight}" if name else weight].float(), "mxfp4",
                                              axis=-2), held.order)
                    held.codes.copy_(fresh.codes)
                    held.scales.copy_(fresh.scales)
            core.prefix_cache.clear()

    def rollouts(self, tasks: Sequence[Task], seed: int, temperature: float = 1.0, max_tokens: int | None = None,
                 progress: bool = False) -> tuple[list[Rollout], RolloutStats]:
        """Roll ``tasks`` out (``max_tokens`` per turn, default the effort's budget + the answer's allowance)."""
        start = time.perf_counter()
        rollouts = generate_completions(self.engine, self.encoder, tasks, temperature=temperature, seed=seed,
                                        max_tokens=max_tokens, progress=progress, logprobs=True)
        seconds = time.perf_counter() - start
        return rollouts, RolloutStats(seconds, sum(r.tokens for r in rollouts))

    def close(self) -> None:
        self.engine.close()


def rollout_rows(rollouts: Sequence[Rollout], advantages: Sequence[float]) -> tuple[list, list, list, list]:
    """(prompts, completions, logprobs, advantages) of the training rows: one row per assistant turn (its prompt
    exactly as the engine saw it, the tokens it sampled), each with its episode's advantage. Turns with no
    tokens, and rollouts whose advantage is 0 (no signal), make no row."""
    prompts, completions, logprobs, advs = [], [], [], []
    for rollout, advantage in zip(rollouts, advantages):
        if advantage == 0.0:
            continue
        for prompt, tokens, lps in zip(rollout.prompt_ids, rollout.token_ids, rollout.logprobs):
            if not tokens:
                continue
            if len(lps) != len(tokens):
                raise RuntimeError(f"the engine gave {len(lps)} log-probabilities for {len(tokens)} tokens")
            prompts.append(prompt)
            completions.append(tokens)
            logprobs.append(lps)
            advs.append(advantage)
    return prompts, completions, logprobs, advs


__all__ = ["RolloutEngine", "RolloutStats", "rollout_rows"]
