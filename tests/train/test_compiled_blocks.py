"""``kimik3.parallel.compile`` (tested here, beside the Trainer's fixtures) and ``kimik3 train --compile``: compiled
blocks give the eager forward and gradients (on a GPU: the CPU's torch KDA does not compile); the default compiles
on a CUDA device in one process only; the CPU and a process group refuse an explicit --compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kimik3.parallel.compile import apply_compile
from kimik3.parallel.context import ParallelContext
from kimik3.train.trainer import Trainer
from tests.train.small_run import small_args


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_give_the_eager_forward_and_grads(small_config_path):
    """In bf16 (the GPU's default) against an fp32 copy of the same weights: where inductor fuses, intermediates stay
    fp32 instead of rounding to bf16 between ops, so the compiled gradients are not the eager ones bit for bit. Each
    gradient, as a whole tensor, is within a few of bf16's epsilon (3.9e-3) of the fp32 one, or no further from it
    than twice the eager bf16 gradient is: a sum that cancels over tokens (the AttnRes pseudo-queries' at their zero
    start) is inexact in bf16 whichever way it is computed."""
    from kimik3 import K3Config, K3ForCausalLM

    config = K3Config.from_json(small_config_path.read_text())
    eager = K3ForCausalLM(config, device="cuda", seed=0).train()
    compiled = K3ForCausalLM(config, device="cuda", seed=0).train()
    reference = K3ForCausalLM(config, device="cuda", dtype=torch.float32, seed=0).train()
    reference.load_state_dict({name: value.float() for name, value in eager.state_dict().items()})
    assert eager.embed.weight.dtype == torch.bfloat16
    assert apply_compile(compiled) == config.num_layers
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    losses = []
    for model in (eager, compiled, reference):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        losses.append(float(out.loss))
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    rows = [(name, _relative_error(b.grad, r.grad), _relative_error(a.grad, r.grad))
            for (name, a), b, r in zip(eager.named_parameters(), compiled.parameters(), reference.parameters())
            if a.grad is not None]
    assert len(rows) > 10
    worse = [row for row in rows if row[1] > max(2 * row[2], 1.5e-2)]
    assert not worse, worse[:5]
    # the Trainer's validation: no grad, another shape (a recompile with symbolic sizes), few rows an expert
    for shape in ((1, 48), (3, 17)):
        short = torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(2)).cuda()
        with torch.no_grad():
            logits = [model.eval()(short).logits for model in (eager, compiled)]
        assert _relative_error(logits[1], logits[0]) < 1e-2, shape


def test_a_compiled_ffn_without_grad_is_one_graph():
    """Under torch.compile the fused projection concatenates its weights (no storage inspection, which would break
    the graph) and the glue ops go through their custom operators, with or without grad."""
    from kimik3.model.ffn import GLUFeedForward
    from kimik3.model.fused_linear import pack_projections

    torch.manual_seed(0)
    ffn = GLUFeedForward(16, 24)
    assert pack_projections(ffn) == 1
    x = torch.randn(2, 5, 16)
    compiled = torch.compile(ffn, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ffn(x))


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="no blocks to compile"):
        apply_compile(nn.Linear(2, 2))


def test_where_the_trainer_compiles(small_config_path, code_corpus, tmp_path):
    """Off by default on the CPU; asked for there, refused before any work, naming why; asked for under a process
    group (any context but the one-process one), refused; that context's default is off."""

    class Grouped(ParallelContext):
        pass

    cpu = torch.device("cpu")
    trainer = Trainer(small_args(small_config_path, code_corpus, tmp_path / "default"), log=lambda _: None)
    assert not trainer.compiled and "blocks compiled" not in trainer._step_kind(trainer.args)
    with pytest.raises(ValueError, match="--compile needs --device cuda"):
        Trainer(small_args(small_config_path, code_corpus, tmp_path / "cpu", compile=True), log=lambda _: None)
    with pytest.raises(ValueError, match="--compile compiles the blocks of a one-process run"):
        Trainer(small_args(small_config_path, code_corpus, tmp_path / "g", compile=True),
                context=Grouped(cpu), log=lambda _: None)
    trainer = Trainer(small_args(small_config_path, code_corpus, tmp_path / "auto"), context=Grouped(cpu),
                      log=lambda _: None)
    assert not trainer.compiled
