"""Activation checkpointing (``kimik3.parallel.activation_checkpoint``) on the small CPU model of
``tests/train/small_run.py`` (KDA, MLA, MoE, AttnRes and MTP in 3 layers of width 32): every mode gives the
loss, the gradients and the routing statistics of no checkpointing; names and checkpoints stay the same;
"selective" keeps less than none and more than full, and recomputes no matmul or attention."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kimik3.model.k3 import K3ForCausalLM
from kimik3.model.moe import RoutingRecord
from kimik3.parallel.activation_checkpoint import (SAVE_OPS, apply_activation_checkpointing, checkpoint_mode,
                                                   checkpointed_blocks, parse_mode)
from kimik3.train.balance import QuantileBalancer
from tests.train.small_run import small_config

MODES = ["full", "selective", "every:2"]
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


def _batch(config, packed: bool, length: int = 48):
    generator = torch.Generator().manual_seed(5)
    rows = 1 if packed else 2
    ids = torch.randint(0, config.vocab_size, (rows, length + 1), generator=generator)
    cu_seqlens = torch.tensor([0, 17, 30, length]) if packed else None
    return ids[:, :-1], ids[:, 1:], cu_seqlens


def _model(config, mode: str) -> K3ForCausalLM:
    model = K3ForCausalLM(config, seed=0).train()
    apply_activation_checkpointing(model, mode)
    return model


def _train_step(mode: str, packed: bool) -> dict:
    """One forward + backward under Quantile Balancing, then its step: what each mode must reproduce."""
    config = small_config()
    model = _model(config, mode)
    balancer = QuantileBalancer(model.routers())
    inputs, labels, cu_seqlens = _batch(config, packed)
    out = model(inputs, labels=labels, cu_seqlens=cu_seqlens)
    loads = [stats.loads_E.clone() for stats in out.routing]
    balancer.observe(out.routing)
    out.loss.backward()
    result = {"loss": out.loss.detach(), "main": out.main_loss.detach(), "mtp": out.mtp_loss.detach(),
              "routed_loads": loads,
              "balancer_loads": [balancer.loads(i).clone() for i in range(len(balancer.routers))],
              "histograms": [balancer.histogram(i).clone() for i in range(len(balancer.routers))],
              "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}
    balancer.step()
    result["biases"] = [router.expert_bias.clone() for router in model.routers()]
    return result


@pytest.fixture(scope="module")
def reference():
    return {packed: _train_step("none", packed) for packed in (False, True)}


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_no_checkpointing(reference, mode, packed):
    """Loss, every parameter's gradient, the routing statistics and the Quantile Balancing state (histograms,
    loads, the biases its step sets) equal those of no checkpointing: the recomputation counts no token twice."""
    expected, got = reference[packed], _train_step(mode, packed)
    for key in ("loss", "main", "mtp"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=0, msg=key)
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-6, atol=1e-9, msg=name)
    for key in ("routed_loads", "balancer_loads", "histograms"):
        assert all(torch.equal(a, b) for a, b in zip(got[key], expected[key], strict=True)), key
    # Each token counted once: by the routers of the layers, and the MTP module's (last) on all but each row's last.
    inputs = _batch(small_config(), packed)[0]
    tokens, rows, top_k = inputs.numel(), inputs.shape[0], small_config().moe.top_k
    routers = len(got["balancer_loads"])
    assert [int(loads.sum()) for loads in got["balancer_loads"]] == \
        [tokens * top_k] * (routers - 1) + [(tokens - rows) * top_k]
    for a, b in zip(got["biases"], expected["biases"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_recomputation_reports_to_no_open_record(mode):
    """Backward called inside an open RoutingRecord: the recomputed routers report nowhere."""
    config = small_config()
    model = _model(config, mode)
    inputs, labels, _ = _batch(config, packed=False)
    with RoutingRecord() as outer:
        out = model(inputs, labels=labels)   # the model's own record, nested, receives the forward's calls
        out.loss.backward()
    assert all(stats is not None for stats in out.routing)
    assert all(stats is None for stats in outer.stats(model.routers()))


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_names_and_checkpoints_unchanged(mode, tmp_path):
    config = small_config()
    plain = K3ForCausalLM(config, seed=1)
    model = _model(config, mode)
    assert type(model) is K3ForCausalLM
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in plain.named_parameters()]
    assert [name for name, _ in model.named_modules()] == [name for name, _ in plain.named_modules()]
    model.load_state_dict(plain.state_dict())   # strict: a checkpoint of the plain model loads
    model.save_pretrained(tmp_path / "model")
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "model")
    for (name, a), (_, b) in zip(loaded.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode, expected", [("none", []), ("full", [0, 1, 2, 3]), ("selective", [0, 1, 2, 3]),
                                            ("every:1", [0, 1, 2, 3]), ("every:2", [0, 2]), ("every:3", [0, 3]),
                                            (True, [0, 1, 2, 3]), (False, [])])
def test_which_blocks_are_checkpointed(mode, expected):
    """The 3 layers, then the MTP module's block (index 3)."""
    from torch.distributed._composable.contract import _get_registry

    model = _model(small_config(), mode)
    blocks = checkpointed_blocks(model)
    assert len(blocks) == 4 and blocks[-1] is model.mtp.block
    assert [i for i, block in enumerate(blocks) if "checkpoint" in (_get_registry(block) or {})] == expected


@pytest.mark.parametrize("mode", ["partial", "Full", "every:0", "every:", "every:-1", "every:x", "every:2.5", "every:²",
                                  2, ""])
def test_bad_mode_is_a_value_error(mode):
    from kimik3.parallel.apply import parallelize
    from kimik3.parallel.context import ParallelContext
    from kimik3.parallel.mesh import ParallelDims
    from torch.distributed._composable.contract import _get_registry

    with pytest.raises(ValueError, match="activation checkpointing mode must be one of none, full, selective"):
        parse_mode(mode)
    model = K3ForCausalLM(small_config(), seed=0)
    for apply in (lambda: apply_activation_checkpointing(model, mode),
                  lambda: parallelize(model, ParallelDims(dp=1), None, activation_checkpointing=mode),
                  lambda: ParallelContext(torch.device("cpu")).wrap_model(model, activation_checkpointing=mode)):
        with pytest.raises(ValueError, match="activation checkpointing mode"):
            apply()
    assert all(_get_registry(block) is None for block in checkpointed_blocks(model))   # nothing applied


def test_mode_spellings():
    assert [checkpoint_mode(m) for m in ("none", "full", "selective", "every:4", True, False, None)] == \
        ["none", "full", "selective", "every:4", "full", "none", "none"]


def test_selective_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    from kimik3.parallel.activation_checkpoint import selective_policy

    aten = torch.ops.aten
    x = torch.ones(2, 2)
    with torch.enable_grad():
        assert selective_policy(None, aten.mm.default, x, x) is CheckpointPolicy.MUST_SAVE
        assert selective_policy(None, aten.add.Tensor, x, x) is CheckpointPolicy.PREFER_RECOMPUTE
        assert selective_policy(None, aten._to_copy.default, x, device=torch.device("cpu")) \
            is CheckpointPolicy.PREFER_RECOMPUTE   # not a device -> host copy
    with torch.no_grad():   # inside an autograd.Function's forward
        assert selective_policy(None, aten.mm.default, x, x) is CheckpointPolicy.PREFER_RECOMPUTE
        collective = torch.ops._c10d_functional.all_to_all_single.default
        assert selective_policy(None, collective, x, [2], [2], "0") is CheckpointPolicy.MUST_SAVE


# ---------------------------------------------------------------------------- what each mode keeps
class _KeptStorages(TorchDispatchMode):
    """Every storage an op makes while it is on, except ``skip``'s (the parameters'): after the forward, the
    live ones are the activations kept for backward (autograd's saved tensors, the checkpoints' inputs and
    the selective cache alike, which ``saved_tensors_hooks`` would not all see: the selective cache is not
    saved through them)."""

    def __init__(self, skip: set[int]):
        super().__init__()
        self.skip = skip
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                seen = self.storages.get(ptr)
                if ptr not in self.skip and (seen is None or seen[0].expired()):
                    self.storages[ptr] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def _kept_bytes(mode: str, length: int = 128) -> int:
    config = small_config()
    model = _model(config, mode)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    inputs, labels, _ = _batch(config, packed=False, length=length)
    with _KeptStorages(skip) as tracker:
        out = model(inputs, labels=labels)
    kept = tracker.live_bytes()
    out.loss.backward()
    return kept


def test_selective_keeps_less_than_none_and_more_than_full():
    kept = {mode: _kept_bytes(mode) for mode in ("none", "full", "selective")}
    assert kept["full"] < kept["selective"] < kept["none"], kept
    assert kept["selective"] < 0.75 * kept["none"], kept


class _GradModeOps(TorchDispatchMode):
    """The ops run with grad mode on (or all of them, ``every_op``): during backward, the recomputed forward's (the
    backward formulas run with it off, and so do the insides of an autograd.Function)."""

    def __init__(self, every_op: bool = False):
        super().__init__()
        self.every_op = every_op
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.every_op or torch.is_grad_enabled():
            self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _recomputed_ops(mode: str, packed: bool) -> Counter:
    config = small_config()
    model = _model(config, mode)
    inputs, labels, cu_seqlens = _batch(config, packed)
    out = model(inputs, labels=labels, cu_seqlens=cu_seqlens)
    seed = torch.ones_like(out.loss)   # made here: inside, backward() would make it with grad mode on
    with _GradModeOps() as seen:
        out.loss.backward(seed)
    return seen.ops


def test_selective_recomputes_the_glue_not_the_matmuls():
    """Packed sequences: the attention takes a mask."""
    none, full, selective = (_recomputed_ops(mode, packed=True) for mode in ("none", "full", "selective"))
    assert not none
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    assert sum(full[op] for op in matmuls) > 0   # full re-runs the projections
    assert not any(op in SAVE_OPS for op in selective), [op for op in selective if op in SAVE_OPS]
    assert sum(selective.values()) > 0           # ... selective the ops between them
    assert sum(selective.values()) < sum(full.values())


# ---------------------------------------------------------------------------- with the other parallelisms
def _distributed_worker(rank, world):
    """Every mode in layouts of 2 gloo ranks (FSDP2 throughout): dp=2 with MoonEP over ep=2, and cp=2 (KCP). What
    this rank computes: loss, the local shard of every gradient, the routing loads."""
    from kimik3.parallel.context import DistributedContext
    from kimik3.parallel.mesh import ParallelDims

    config = small_config()
    inputs, labels, _ = _batch(config, packed=False)
    out = {}
    for layout, dims in (("ep2", ParallelDims(dp=2, ep=2)), ("cp2", ParallelDims(dp=1, cp=2))):
        ctx = DistributedContext(torch.device("cpu"), dims)
        x, y = ctx.shard_batch(inputs, labels)
        for mode in ("none", "full", "selective"):
            model = K3ForCausalLM(config, seed=0).train()
            ctx.wrap_model(model, activation_checkpointing=mode)
            result = model(x, labels=y)
            loss = ctx.backward_loss(result.loss)
            seed = torch.ones_like(loss)
            with _GradModeOps(every_op=True) as seen:
                loss.backward(seed)
            out[f"{layout}.{mode}.backward_all_to_alls"] = torch.tensor(seen.ops[ALL_TO_ALL])
            out[f"{layout}.{mode}.loss"] = result.loss.detach()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    out[f"{layout}.{mode}.grad.{name}"] = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            for index, stats in enumerate(result.routing):
                out[f"{layout}.{mode}.loads.{index}"] = stats.loads_E
    return out


def test_modes_under_fsdp_moonep_and_kcp(tmp_path, monkeypatch):
    """On each rank, full and selective give the loss, gradients and routing of no checkpointing, also when the
    recomputed blocks hold MoonEP's all-to-alls or KCP's exchanges; selective does not send MoonEP's again."""
    from tests.parallel.gloo import run_ranks

    outs = run_ranks(_distributed_worker, 2, tmp_path)
    for rank, out in enumerate(outs):
        for layout in ("ep2", "cp2"):
            keys = sorted(key[len(f"{layout}.none."):] for key in out if key.startswith(f"{layout}.none."))
            assert any(key.startswith("grad.") for key in keys) and any(key.startswith("loads.") for key in keys)
            for mode in ("full", "selective"):
                assert sorted(k[len(f"{layout}.{mode}."):] for k in out if k.startswith(f"{layout}.{mode}.")) == keys
                for key in (k for k in keys if k != "backward_all_to_alls"):
                    torch.testing.assert_close(out[f"{layout}.{mode}.{key}"], out[f"{layout}.none.{key}"], rtol=1e-6,
                                               atol=1e-9, msg=f"rank {rank} {layout} {mode} {key}")
        # MoonEP's all-to-alls in backward: the gradients' own; full sends the forward's again, selective keeps them.
        sent = {mode: int(out[f"ep2.{mode}.backward_all_to_alls"]) for mode in ("none", "full", "selective")}
        assert 0 < sent["none"] == sent["selective"] < sent["full"], sent


# ---------------------------------------------------------------------------- the trainer and the command line
def test_trainer_steps_are_the_same_under_every_mode(tmp_path, monkeypatch):
    """Three steps of ``kimik3 train``'s loop (Quantile Balancing on, its biases updated after each step): the same
    losses with selective checkpointing as without."""
    from kimik3.train.trainer import Trainer
    from tests.corpus import write_code_corpus
    from tests.train.small_run import small_args, write_small_config

    monkeypatch.setenv("KIMIK3_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus").mkdir()
    corpus = write_code_corpus(tmp_path / "corpus", 20)
    config = write_small_config(tmp_path)
    losses = {}
    for mode in ("none", "selective"):
        trainer = Trainer(small_args(config, corpus, tmp_path / mode), log=lambda _: None,
                          activation_checkpointing=mode)
        trainer.started = 0.0   # what run() sets before its first step (train_step reports the time since)
        losses[mode] = [trainer.train_step(step, 3)["loss"] for step in range(3)]
    assert losses["selective"] == pytest.approx(losses["none"], rel=1e-6)


def test_trainer_refuses_a_bad_mode_before_any_work(tmp_path):
    from kimik3.train.trainer import TrainArgs, Trainer

    args = TrainArgs(data=str(tmp_path / "missing"), out=str(tmp_path / "out"), steps=1, progress=False)
    with pytest.raises(ValueError, match="activation checkpointing mode"):
        Trainer(args, log=lambda _: None, activation_checkpointing="sometimes")


def test_cli_option():
    from kimik3.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["train"]).activation_checkpointing == "none"
    for mode in ("none", "full", "selective", "every:3"):
        assert parser.parse_args(["train", "--activation-checkpointing", mode]).activation_checkpointing == mode
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--activation-checkpointing", "sometimes"])
