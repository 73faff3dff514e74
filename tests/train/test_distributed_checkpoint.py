"""Sharded checkpoints through torch.distributed.checkpoint (``kimik3.train.distributed_checkpoint``).

The multi-rank test trains the ``tiny`` preset (fp32, CPU) under FSDP2 on 2 gloo ranks with the
trainer's optimizer (``build_param_groups``: Muon + AdamW in a ``MultiOptimizer``), checkpoints it
after 2 steps (once synchronously, once asynchronously while training goes on) and trains 2 more
steps. Then the checkpoint is loaded (a) by 2 fresh ranks, which must log the very same losses, and
(b) by one plain process without a process group (DCP reshards the FSDP shards into full tensors),
which trains on the same global batches: equal within fp32 noise only, as the gradient reduction and
Muon's orthogonalisation of sharded matrices sum in another order.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kimik3.config.schema import K3Config
from kimik3.model.k3 import K3ForCausalLM
from kimik3.optim import build_param_groups
from kimik3.train.checkpoint import CheckpointError
from kimik3.train.distributed_checkpoint import META_FILE, load_distributed, save_distributed
from tests.parallel.gloo import run_ranks

LR = 3e-3
BATCH, SEQ = 4, 32
# One process against 2 FSDP ranks: same batches, same math, another summation order.
RTOL_ONE_PROCESS = 1e-5


def _model(config: K3Config, seed: int = 0) -> K3ForCausalLM:
    return K3ForCausalLM(config, seed=seed, dtype=torch.float32)


def _batch(config: K3Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a pure function of the step, as in the trainer."""
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return ids[:, :-1], ids[:, 1:]


def _train_step(model, optimizer, config, step, ctx=None) -> float:
    """One optimizer step on the global batch of ``step`` (``ctx``: this rank's rows); the global loss."""
    inputs, labels = _batch(config, step)
    if ctx is not None:
        inputs, labels = ctx.shard_batch(inputs, labels)
    loss = model(inputs, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(ctx.global_loss(loss.detach()) if ctx is not None else loss.detach())


# ---------------------------------------------------------------------------- two ranks, then one process
def _fsdp(config, world):
    from kimik3.parallel.context import DistributedContext
    from kimik3.parallel.mesh import ParallelDims

    ctx = DistributedContext(torch.device("cpu"), ParallelDims(dp=world))
    model = _model(config, seed=0)
    ctx.wrap_model(model)
    return ctx, model, build_param_groups(model, lr=LR)


def _two_rank_worker(rank, world, directory):
    config = K3Config.preset("tiny")
    ctx, model, optimizer = _fsdp(config, world)
    before = [_train_step(model, optimizer, config, step, ctx) for step in range(2)]
    save_distributed(f"{directory}/sync", model, optimizer, 2, {"losses": before})
    pending = save_distributed(f"{directory}/async", model, optimizer, 2, {"losses": before}, async_save=True)
    # Training changes the parameters in place while the async save may still be writing.
    after = [_train_step(model, optimizer, config, step, ctx) for step in (2, 3)]
    published = pending.result()
    out = {"before": torch.tensor(before), "after": torch.tensor(after),
           "published": torch.tensor(published.name == "async")}
    for name in ("sync", "async"):
        ctx, model, optimizer = _fsdp(config, world)
        step, extra = load_distributed(f"{directory}/{name}", model, optimizer)
        out[f"{name}.meta_ok"] = torch.tensor(step == 2 and extra == {"losses": before})
        out[f"{name}.after"] = torch.tensor([_train_step(model, optimizer, config, s, ctx) for s in (2, 3)])
    return out


def test_fsdp2_checkpoint_reloads_on_two_ranks_and_in_one_process(tmp_path):
    outs = run_ranks(_two_rank_worker, 2, tmp_path, str(tmp_path))
    assert torch.equal(outs[0]["after"], outs[1]["after"]), "every rank logs the same global loss"
    expected = outs[0]["after"]
    for out in outs:
        assert bool(out["published"])
        for name in ("sync", "async"):
            assert bool(out[f"{name}.meta_ok"]), name
            # (a) 2 ranks resuming: bit for bit the losses of the run that went on.
            assert torch.equal(out[f"{name}.after"], expected), (name, out[f"{name}.after"], expected)
    # Each rank wrote its own shards, about half of the state (nothing was gathered); nothing temporary is left.
    shards = {p.name: p.stat().st_size for p in (tmp_path / "sync").glob("*.distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"]
    assert max(shards.values()) < 0.6 * sum(shards.values()), shards
    assert not list(tmp_path.glob(".*.partial"))
    assert json.loads((tmp_path / "sync" / META_FILE).read_text())["world_size"] == 2

    # (b) One process, no process group, no FSDP: the same optimizer construction and global batches.
    config = K3Config.preset("tiny")
    model = _model(config, seed=1)   # other weights: the load must replace them all
    optimizer = build_param_groups(model, lr=LR)
    step, extra = load_distributed(tmp_path / "async", model, optimizer)
    assert step == 2 and extra == {"losses": outs[0]["before"].tolist()}
    single = torch.tensor([_train_step(model, optimizer, config, s) for s in (2, 3)])
    print("losses after the checkpoint: 2 ranks", expected.tolist(), "1 process", single.tolist())
    torch.testing.assert_close(single, expected, rtol=RTOL_ONE_PROCESS, atol=0)


# ---------------------------------------------------------------------------- one process, no process group
def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for member, opt in optimizer.optimizers.items():
        for param, slots in opt.state.items():
            for key, value in slots.items():
                state[f"{member}.{names[param]}.{key}"] = torch.as_tensor(value).clone()
    return state


def _assert_same(found, expected):
    assert found.keys() == expected.keys()
    for key in expected:
        assert torch.equal(found[key], expected[key]), key


# DCP warns of every single-process save; an async one warns from its thread, past our filter.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_round_trip_is_exact(tmp_path):
    config = K3Config.preset("tiny")
    model = _model(config)
    optimizer = build_param_groups(model, lr=LR)
    _train_step(model, optimizer, config, 0)
    saved = _snapshot(model, optimizer)
    assert save_distributed(tmp_path / "ckpt", model, optimizer, 1, {"note": "x"}) == tmp_path / "ckpt"
    pending = save_distributed(tmp_path / "async", model, optimizer, 1, async_save=True)
    next_loss = _train_step(model, optimizer, config, 1)   # changes the state under the async save
    assert pending.result() == tmp_path / "async"

    for name, extra in (("ckpt", {"note": "x"}), ("async", {})):
        fresh = _model(config, seed=1)
        fresh_optimizer = build_param_groups(fresh, lr=1.0)   # lr too comes from the checkpoint
        assert load_distributed(tmp_path / name, fresh, fresh_optimizer) == (1, extra)
        _assert_same(_snapshot(fresh, fresh_optimizer), saved)
        assert fresh_optimizer.param_groups[0]["lr"] == LR
        assert _train_step(fresh, fresh_optimizer, config, 1) == next_loss, name
    assert not list(tmp_path.glob(".*"))   # no temporaries left


def _small():
    from tests.train.small_run import small_config

    config = small_config()
    model = _model(config)
    optimizer = build_param_groups(model, lr=LR)
    _train_step(model, optimizer, config, 0)
    return config, model, optimizer


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import kimik3.train.distributed_checkpoint as module

    config, model, optimizer = _small()
    target = tmp_path / "ckpt"
    save_distributed(target, model, optimizer, 1)
    saved = _snapshot(model, optimizer)
    _train_step(model, optimizer, config, 1)

    def crash(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr(module, "_publish", crash)
    with pytest.raises(OSError, match="killed before the rename"):
        save_distributed(target, model, optimizer, 2)
    assert (tmp_path / ".ckpt.partial" / ".metadata").is_file()   # written, never published
    fresh = _model(config, seed=1)
    fresh_optimizer = build_param_groups(fresh, lr=LR)
    assert load_distributed(target, fresh, fresh_optimizer)[0] == 1
    _assert_same(_snapshot(fresh, fresh_optimizer), saved)

    monkeypatch.undo()
    save_distributed(target, model, optimizer, 2)   # replaces step 1 and clears the leftover
    assert load_distributed(target, fresh, fresh_optimizer)[0] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_errors(tmp_path):
    config, model, optimizer = _small()
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_distributed(tmp_path / "absent", model, optimizer)

    # A save interrupted before its rename: only the .partial directory exists.
    good = tmp_path / "good"
    save_distributed(good, model, optimizer, 1)
    partial = tmp_path / ".gone.partial"
    shutil.copytree(good, partial)
    (partial / META_FILE).unlink()
    with pytest.raises(CheckpointError, match="gone: no such checkpoint; .*incomplete"):
        load_distributed(tmp_path / "gone", model, optimizer)
    with pytest.raises(CheckpointError, match="an incomplete checkpoint"):
        load_distributed(partial, model, optimizer)
    for missing in (META_FILE, ".metadata"):
        broken = tmp_path / f"without{missing}"
        shutil.copytree(good, broken)
        (broken / missing).unlink()
        with pytest.raises(CheckpointError, match=f"incomplete or not a distributed checkpoint \\({missing} is"):
            load_distributed(broken, model, optimizer)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_distributed(tmp_path / "file", model, optimizer)
    malformed = tmp_path / "malformed"
    shutil.copytree(good, malformed)
    (malformed / META_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="kimik3_dcp.json: malformed"):
        load_distributed(malformed, model, optimizer)

    # Another optimizer, another model.
    with pytest.raises(CheckpointError, match=r"optimizer is \['muon', 'adamw'\], this run's is 'single'"):
        load_distributed(good, model, torch.optim.AdamW(model.parameters()))
    spec = config.to_dict()
    spec.update(vocab_size=768)
    wider = _model(K3Config.from_dict(spec))
    with pytest.raises(CheckpointError, match=r"shapes differ.*embed.weight: \(640, 32\) saved, \(768, 32\)"):
        load_distributed(good, wider, build_param_groups(wider, lr=LR))
    spec.update(vocab_size=640, num_layers=2)   # another layer layout: names the checkpoint lacks
    other = _model(K3Config.from_dict(spec))
    with pytest.raises(CheckpointError, match="the checkpoint has no 'layers.1.* more model entries.*a different"):
        load_distributed(good, other, build_param_groups(other, lr=LR))
    spec.update(num_layers=3, mtp={**spec["mtp"], "num_modules": 0})   # a part of the checkpoint's model
    without_mtp = _model(K3Config.from_dict(spec))
    with pytest.raises(CheckpointError, match="the model has no 'mtp.* more checkpoint entries.*a different"):
        load_distributed(good, without_mtp, build_param_groups(without_mtp, lr=LR))

    # Bad arguments fail before anything is written.
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_distributed(tmp_path / "bad", model, optimizer, -1)
    with pytest.raises(TypeError, match="not JSON serializable"):
        save_distributed(tmp_path / "bad", model, optimizer, 1, {"t": torch.ones(1)})
    assert not (tmp_path / "bad").exists() and not (tmp_path / ".bad.partial").exists()
