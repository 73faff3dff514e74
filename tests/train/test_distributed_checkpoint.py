"""Sharded checkpoints through torch.distributed.checkpoint (``kimik3.train.distributed_checkpoint``).

The multi-rank test trains the small test model (``tests.train.small_run``; fp32, CPU) under FSDP2 on 2 gloo
ranks with the trainer's optimizer (``build_param_groups``: Muon + AdamW in a ``MultiOptimizer``), checkpoints it
after 2 steps (once synchronously, once asynchronously while training goes on) and trains 2 more
steps. Then the checkpoint is loaded (a) by 2 fresh ranks, which must log the very same losses, and
(b) by one plain process without a process group (DCP reshards the FSDP shards into full tensors),
which trains on the same global batches: equal within fp32 noise only, as the gradient reduction and
Muon's orthogonalisation of sharded matrices sum in another order.

The loads run with ``pickle.load`` / ``pickle.loads`` / ``pickle.Unpickler`` and ``torch.load`` replaced
by functions that record the call and raise (``_pickle_banned``), and every checkpoint directory holds
JSON and safetensors files only (``_assert_pickle_free``). (torch.distributed's object collectives,
which DCP uses to exchange its plans between the ranks of the job, keep their own reference to
``pickle.Unpickler``: they read what another rank of the same job just sent, never a file.)
"""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open

from kimik3.config.schema import K3Config
from kimik3.model.k3 import K3ForCausalLM
from kimik3.optim import build_param_groups
from kimik3.train.checkpoint import CheckpointError
from kimik3.train.dcp_storage import INDEX_FILE
from kimik3.train.distributed_checkpoint import META_FILE, load_distributed, save_distributed
from tests.parallel.gloo import run_ranks
from tests.train.small_run import small_config

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


@contextlib.contextmanager
def _pickle_banned(check: bool = True):
    """Every way to unpickle (and ``torch.load``) records the call and raises, for the ``with`` block; with
    ``check`` the block must also end with no call recorded (in case something caught the error). Yields
    the list of calls."""
    calls = []

    def banned(name):
        def refuse(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called while loading a checkpoint")
        return refuse

    with contextlib.ExitStack() as stack:
        for target in (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"), \
                (torch.serialization, "load"):
            stack.enter_context(mock.patch.object(*target, banned(f"{target[0].__name__}.{target[1]}")))
        yield calls
    assert not (check and calls), calls


def _assert_pickle_free(directory: Path, shards: int) -> None:
    """``directory`` holds the index and metadata JSON and ``shards`` safetensors shard files, nothing else:
    no pickle (DCP's ``.metadata``) and no torch.save file (``.distcp``)."""
    names = sorted(p.name for p in directory.iterdir())
    shard_names = [f"shard-{i:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    assert names == sorted([INDEX_FILE, META_FILE, *shard_names]), names
    for name in names:
        data = (directory / name).read_bytes()
        if name.endswith(".json"):
            assert data[:1] == b"{" and isinstance(json.loads(data), dict), name   # (a pickle starts with 0x80)
        else:
            # 8 bytes of header length, then the JSON header; safe_open checks that the header describes
            # exactly the bytes that follow.
            assert data[8:9] == b"{", name
            with safe_open(str(directory / name), framework="pt") as handle:
                assert len(list(handle.keys())) > 0, name


# ---------------------------------------------------------------------------- two ranks, then one process
def _fsdp(config, world):
    from kimik3.parallel.context import DistributedContext
    from kimik3.parallel.mesh import ParallelDims

    ctx = DistributedContext(torch.device("cpu"), ParallelDims(dp=world))
    model = _model(config, seed=0)
    ctx.wrap_model(model)
    return ctx, model, build_param_groups(model, lr=LR)


def _two_rank_worker(rank, world, directory):
    config = small_config()
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
        with _pickle_banned():
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
    for name in ("sync", "async"):
        _assert_pickle_free(tmp_path / name, shards=2)
    shards = {p.name: p.stat().st_size for p in (tmp_path / "sync").glob("shard-*")}
    assert max(shards.values()) < 0.6 * sum(shards.values()), shards
    assert not list(tmp_path.glob(".*.partial"))
    assert json.loads((tmp_path / "sync" / META_FILE).read_text())["world_size"] == 2

    # (b) One process, no process group, no FSDP: the same optimizer construction and global batches.
    config = small_config()
    model = _model(config, seed=1)   # other weights: the load must replace them all
    optimizer = build_param_groups(model, lr=LR)
    with _pickle_banned():
        step, extra = load_distributed(tmp_path / "async", model, optimizer)
    assert step == 2 and extra == {"losses": outs[0]["before"].tolist()}
    single = torch.tensor([_train_step(model, optimizer, config, s) for s in (2, 3)])
    print("losses after the checkpoint: 2 ranks", expected.tolist(), "1 process", single.tolist())
    torch.testing.assert_close(single, expected, rtol=RTOL_ONE_PROCESS, atol=0)


def _reshard_worker(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(3, 7)   # 7 rows on 2 ranks: 4 and 3, each a slice of the saved one-process chunk
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    with _pickle_banned():
        step, _ = load_distributed(f"{directory}/one", model, None)
    return {"step": torch.tensor(step), "rows": torch.tensor(model.weight.to_local().shape[0]),
            "weight": model.weight.full_tensor(), "bias": model.bias.full_tensor()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_one_process_checkpoint_reshards_onto_two_ranks(tmp_path):
    """Each rank reads only its rows out of the one chunk a single process saved (a sliced read)."""
    saved = torch.nn.Linear(3, 7)
    save_distributed(tmp_path / "one", saved, None, 5)
    _assert_pickle_free(tmp_path / "one", shards=1)
    outs = run_ranks(_reshard_worker, 2, tmp_path, str(tmp_path))
    assert [int(out["rows"]) for out in outs] == [4, 3]
    for out in outs:
        assert int(out["step"]) == 5
        assert torch.equal(out["weight"], saved.weight.detach()) and torch.equal(out["bias"], saved.bias.detach())


# ---------------------------------------------------------------------------- one process, no process group
def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for member, opt in optimizer.optimizers.items():
        for param, slots in opt.state.items():
            for key, value in slots.items():
                if isinstance(value, (torch.Tensor, int, float)):   # (not test_non_tensor_values_...'s tuple)
                    state[f"{member}.{names[param]}.{key}"] = torch.as_tensor(value).clone()
    return state


def _assert_same(found, expected):
    assert found.keys() == expected.keys()
    for key in expected:
        assert torch.equal(found[key], expected[key]), key


def _groups(optimizer) -> dict[str, list[dict]]:
    """Every member's param groups without their parameters (tuples stay tuples: ('rows', 4) != ['rows', 4])."""
    return {name: [{k: v for k, v in group.items() if k != "params"} for group in member.param_groups]
            for name, member in optimizer.optimizers.items()}


# DCP warns of every single-process save; an async one warns from its thread, past our filter.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_round_trip_is_exact(tmp_path):
    config = small_config()
    model = _model(config)
    optimizer = build_param_groups(model, lr=LR)
    _train_step(model, optimizer, config, 0)
    saved = _snapshot(model, optimizer)
    assert save_distributed(tmp_path / "ckpt", model, optimizer, 1, {"note": "x"}) == tmp_path / "ckpt"
    pending = save_distributed(tmp_path / "async", model, optimizer, 1, async_save=True)
    next_loss = _train_step(model, optimizer, config, 1)   # changes the state under the async save
    assert pending.result() == tmp_path / "async"

    for name, extra in (("ckpt", {"note": "x"}), ("async", {})):
        _assert_pickle_free(tmp_path / name, shards=1)
        fresh = _model(config, seed=1)
        fresh_optimizer = build_param_groups(fresh, lr=1.0)   # lr too comes from the checkpoint
        with _pickle_banned():
            assert load_distributed(tmp_path / name, fresh, fresh_optimizer) == (1, extra)
        _assert_same(_snapshot(fresh, fresh_optimizer), saved)
        assert fresh_optimizer.param_groups[0]["lr"] == LR
        assert _groups(fresh_optimizer) == _groups(optimizer)   # Muon's split tuples included
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
    assert (tmp_path / ".ckpt.partial" / INDEX_FILE).is_file()   # written, never published
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
    for missing in (META_FILE, INDEX_FILE):
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
    bad_index = tmp_path / "bad_index"
    shutil.copytree(good, bad_index)
    index = json.loads((bad_index / INDEX_FILE).read_text())
    next(iter(index["tensors"].values()))["chunks"][0]["file"] = "../good/shard-00000-of-00001.safetensors"
    (bad_index / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="dcp_index.json: malformed.*not a shard file name"):
        load_distributed(bad_index, model, optimizer)
    (bad_index / INDEX_FILE).write_text("[]")
    with pytest.raises(CheckpointError, match="dcp_index.json: malformed"):
        load_distributed(bad_index, model, optimizer)

    # DCP's default storage (what this module wrote before): pickles, refused before anything is read. The ban
    # shows that DCP's own reader would unpickle it.
    import torch.distributed.checkpoint as dcp

    pickled = tmp_path / "pickled"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(2), "groups": [{"betas": (0.9, 0.95)}]}, checkpoint_id=pickled, no_dist=True)
    (pickled / META_FILE).write_text(json.dumps({"format": "kimik3-dcp", "version": 1, "step": 1}))
    with _pickle_banned(), pytest.raises(CheckpointError, match="pickle format.*never unpickles"):
        load_distributed(pickled, model, optimizer)
    with _pickle_banned(check=False) as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException):   # (DCP wraps the error in its CheckpointException, a BaseException)
            dcp.load({"x": torch.zeros(2)}, checkpoint_id=pickled, no_dist=True)
    assert "pickle.load" in calls

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
    optimizer.optimizers["adamw"].param_groups[0]["hook"] = object()   # a value JSON cannot hold
    with pytest.raises(TypeError, match=r"optim\.adamw\.param_groups\.0\.hook: a object cannot be saved"):
        save_distributed(tmp_path / "bad", model, optimizer, 1)
    assert not (tmp_path / "bad").exists() and not (tmp_path / ".bad.partial").exists()


class _CountingSGD(torch.optim.SGD):
    """SGD keeping a non-tensor slot per parameter too (as torch's Adam once kept an int ``step``)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param]["visits"] = (self.state[param].get("visits", (0,))[0] + 1, 0.5)
        return super().step(closure)


def test_non_tensor_values_round_trip_through_json(tmp_path):
    """Values JSON has no form for (tuples, dtypes, dicts keyed otherwise than by plain strings), in param
    groups and in optimizer slots, come back equal and of the same types; a plain torch optimizer."""
    from tests.train.small_run import small_config

    config = small_config()
    model = _model(config)
    optimizer = _CountingSGD(model.parameters(), lr=LR, momentum=0.9)
    odd = {"dtype": torch.bfloat16, "pairs": [(1, 2.5), None, ("a", (True,))], "keys": {1: "one", "__x": (2,)},
           "inf": float("inf")}
    optimizer.param_groups[0].update(odd)
    for step in range(2):
        _train_step(model, optimizer, config, step)
    save_distributed(tmp_path / "ckpt", model, optimizer, 2)
    _assert_pickle_free(tmp_path / "ckpt", shards=1)
    objects = json.loads((tmp_path / "ckpt" / META_FILE).read_text())["objects"]
    group = objects["optim"]["param_groups"][0]
    assert group["dtype"] == {"__dtype__": "bfloat16"} and group["pairs"][0] == {"__tuple__": [1, 2.5]}
    assert group["keys"] == {"__dict__": [[1, "one"], ["__x", {"__tuple__": [2]}]]}
    assert {slots["visits"]["__tuple__"][0] for slots in objects["optim"]["state"].values()} == {2}

    fresh = _model(config, seed=1)
    fresh_optimizer = _CountingSGD(fresh.parameters(), lr=1.0, momentum=0.9)
    with _pickle_banned():
        assert load_distributed(tmp_path / "ckpt", fresh, fresh_optimizer) == (2, {})
    without_params = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in fresh_optimizer.param_groups] == without_params
    names = {p: n for n, p in model.named_parameters()}
    fresh_params = dict(fresh.named_parameters())
    assert optimizer.state, "some parameters have state"
    for param, slots in optimizer.state.items():
        loaded = fresh_optimizer.state[fresh_params[names[param]]]
        assert loaded["visits"] == slots["visits"] == (2, 0.5)   # (no str: torch mangles one in a slot)
        assert torch.equal(loaded["momentum_buffer"], slots["momentum_buffer"])
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
