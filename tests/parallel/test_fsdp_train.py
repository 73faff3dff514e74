"""Distributed training (FSDP2, MoonEP, KCP; gloo) through the real trainer, against single-process runs.

The model is the 3-layer, width-32 test model of ``tests/train/small_run.py`` (KDA with a dense FFN,
KDA + MoE, MLA + MoE, AttnRes, MTP): every mechanism at a tenth of a second a step. Reference: one
single-process run of 4 steps, interrupted after step 2 (checkpoint at 2) and resumed. Every layout
must reproduce its losses (the global batch of a step is the single-process batch; only reduction
order differs), and checkpoints cross between the two kinds of run in both directions.

Starting ranks costs more than training this model, so one 2-rank process group runs every 2-rank
case in turn (each layout builds its own mesh) and one test checks them all, each case in a
``_check_*`` function of its own; one 4-rank group runs dp=2 x ep=2 x cp=2. (One test, not a shared
fixture: pytest-xdist hands a module's tests to both workers, which would each start the group.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimik3.model.pretrained import has_weights
from tests.corpus import write_code_corpus
from tests.parallel.gloo import run_ranks
from tests.train.small_run import small_config

RTOL = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_code_corpus(tmp_path_factory.mktemp("corpus"), 40)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    from tests.train.small_run import write_small_config

    return write_small_config(tmp_path_factory.mktemp("config"))


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    # Spawned ranks inherit the environment: one tokenizer cache for the whole module.
    saved = os.environ.get("KIMIK3_CACHE")
    os.environ["KIMIK3_CACHE"] = str(tmp_path_factory.mktemp("kimik3-cache"))
    yield
    if saved is None:
        os.environ.pop("KIMIK3_CACHE", None)
    else:
        os.environ["KIMIK3_CACHE"] = saved


def _args(config_path, corpus, out, **changes):
    from kimik3.train.trainer import TrainArgs

    base = dict(config_path=str(config_path), data=str(corpus), steps=4, out=str(out), seq_len=64, batch_size=4,
                eval_every=100, eval_windows=2, checkpoint_every=2, progress=False, lr=3e-3)
    base.update(changes)
    return TrainArgs(**base)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _fast(trainer_cls):
    """Skip the end-of-run sample and evaluation (the CLI test below runs them under FSDP). Training,
    checkpoints and metrics are untouched."""
    trainer_cls.sample = lambda self, prompt, max_new_tokens=80: ""
    trainer_cls.evaluate = lambda self: 0.0


def _crash_after(step):
    def on_step(record):
        if record["step"] == step:
            raise KeyboardInterrupt
    return on_step


def _train(config_path, corpus, out, dims, *, resume=False, crash_after=None) -> torch.Tensor:
    """Train (or resume) the 4-step run in layout ``dims`` on this rank; the losses it logged."""
    from kimik3.train.trainer import TrainArgs, Trainer

    if resume:
        trainer = Trainer(TrainArgs(progress=False), resume=out, log=lambda _: None, parallel=dims)
    else:
        trainer = Trainer(_args(config_path, corpus, out), log=lambda _: None, parallel=dims)
    history = []
    try:
        trainer.run(on_step=lambda r: (history.append(r["loss"]),
                                       crash_after is not None and _crash_after(crash_after)(r)))
    except KeyboardInterrupt:
        pass
    return torch.tensor(history, dtype=torch.float64)


@pytest.fixture(scope="module", autouse=True)
def fast_trainer():
    from kimik3.train.trainer import Trainer

    saved, threads = (Trainer.sample, Trainer.evaluate), torch.get_num_threads()
    _fast(Trainer)
    torch.set_num_threads(1)  # like each gloo rank; 2 threads on 2 shared cores spin-wait
    yield
    Trainer.sample, Trainer.evaluate = saved
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(config_path, corpus, tmp_path_factory):
    """The single-process losses of the 4-step run, and a copy of that run as it was when interrupted
    after step 2 (checkpoint at step 2), for a distributed run to resume."""
    from kimik3.train.trainer import TrainArgs, Trainer

    runs = tmp_path_factory.mktemp("runs")
    out = runs / "single"
    with pytest.raises(KeyboardInterrupt):
        Trainer(_args(config_path, corpus, out), log=lambda _: None).run(on_step=_crash_after(2))
    shutil.copytree(out, runs / "interrupted", symlinks=True)
    Trainer(TrainArgs(progress=False), resume=out, log=lambda _: None).run()
    return _losses(out), runs / "interrupted"


def _close(found, expected, msg=""):
    torch.testing.assert_close(torch.tensor(found, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=RTOL, atol=0, msg=msg)


# ---------------------------------------------------------------------------- two ranks, every case
def _two_rank_worker(rank, world, config_path, corpus, runs, interrupted):
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import Trainer

    _fast(Trainer)
    out = {
        # dp=2, interrupted after 3 steps (checkpoint at step 2, as checkpoint_every=2)
        "dp2": _train(config_path, corpus, f"{runs}/dp2", ParallelDims(dp=2), crash_after=2),
        # dp=2 resuming the single-process run interrupted after step 2
        "resumed": _train(config_path, corpus, interrupted, ParallelDims(dp=2), resume=True),
        # dp=2 with the experts split over the same 2 ranks (MoonEP exchange, perfectly balanced)
        "ep2": _train(config_path, corpus, f"{runs}/ep2", ParallelDims(dp=2, ep=2), crash_after=2),
        # each sequence split over 2 ranks (KDA context parallelism)
        "cp2": _train(config_path, corpus, f"{runs}/cp2", ParallelDims(dp=1, cp=2), crash_after=2),
    }
    for name, case in (("context", _context_case), ("muon", _muon_case), ("layout", _shard_layout_case),
                       ("parallelize", _parallelize_case)):
        out.update({f"{name}.{key}": value for key, value in case(rank, world).items()})
    return out


def test_two_ranks_in_every_layout(reference, config_path, corpus, tmp_path):
    """dp=2, ep=2 and cp=2 training against the single-process run with checkpoints both ways, the
    distributed context, Muon under FSDP2, activation checkpointing + FSDP2: one 2-rank group."""
    _, interrupted = reference
    outs = run_ranks(_two_rank_worker, 2, tmp_path, str(config_path), str(corpus), str(tmp_path), str(interrupted),
                     timeout=900)
    _check_training(reference, outs, tmp_path, interrupted)
    _check_context(outs)
    _check_muon(outs)
    _check_shard_layout(outs)
    _check_parallelize(outs)


def _check_training(reference, outs, runs, interrupted):
    """Every layout reproduces the single-process losses, and checkpoints cross both ways."""
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.train.trainer import TrainArgs, Trainer

    expected, _ = reference
    for layout in ("dp2", "ep2", "cp2"):
        assert torch.equal(outs[0][layout], outs[1][layout]), f"{layout}: every rank logs the same global loss"
        _close(outs[0][layout].tolist(), expected[:3], msg=layout)
    assert _losses(runs / "dp2") == outs[0]["dp2"].tolist()  # rank 0 wrote the metrics
    assert json.loads((runs / "dp2" / "train_state.json").read_text())["step"] == 2

    # The single-process checkpoint resumed under dp=2 ...
    _close(outs[0]["resumed"].tolist(), expected[2:], msg="dp2 resuming a single-process checkpoint")
    _close(_losses(interrupted), expected, msg="dp2 resuming a single-process checkpoint")
    # ... and the dp=2 and ep=2 checkpoints (full tensors; the ep one gathers the experts) in one process.
    for layout in ("dp2", "ep2"):
        K3ForCausalLM.from_pretrained(runs / layout)
        Trainer(TrainArgs(progress=False), resume=runs / layout, log=lambda _: None).run()
        _close(_losses(runs / layout), expected, msg=f"{layout} resumed in one process")


def test_dp2_ep2_cp2_on_four_ranks_matches_single_process(reference, config_path, corpus, tmp_path):
    """All three at once (4 gloo ranks): 2 data-parallel groups, experts over the 2 dp ranks, each
    sequence over 2 cp ranks (EP weight gradients then also sum over the 2 cp replicas)."""
    expected, _ = reference
    outs = run_ranks(_four_rank_worker, 4, tmp_path, str(config_path), str(corpus), str(tmp_path / "mix"))
    assert all(torch.equal(outs[0]["losses"], o["losses"]) for o in outs)
    _close(outs[0]["losses"].tolist(), expected[:3])


def _four_rank_worker(rank, world, config_path, corpus, out):
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import Trainer

    _fast(Trainer)
    return {"losses": _train(config_path, corpus, out, ParallelDims(dp=2, ep=2, cp=2), crash_after=2)}


def test_parallel_dims_errors():
    from kimik3.parallel.mesh import ParallelDims

    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        ParallelDims(dp=4, ep=3)
    with pytest.raises(ValueError, match="dp must be an int >= 1"):
        ParallelDims(dp=0)
    with pytest.raises(ValueError, match="2 x cp=2 = 4 ranks, but the world has 2"):
        ParallelDims(dp=2, cp=2).check_world(2)
    with pytest.raises(ValueError, match="cp=3 must divide the world size 4"):
        ParallelDims.for_world(4, cp=3)
    assert ParallelDims.for_world(4, cp=2) == ParallelDims(dp=2, cp=2)


# ---------------------------------------------------------------------------- the training context
def _context_case(rank, world):
    """What the distributed context does with a batch, a loss and a string, on dp=2."""
    from kimik3.parallel.context import DistributedContext
    from kimik3.parallel.mesh import ParallelDims

    ctx = DistributedContext(torch.device("cpu"), ParallelDims(dp=world))
    batch = torch.arange(4 * 3).view(4, 3)
    (rows,) = ctx.shard_batch(batch)
    try:
        ctx.shard_batch(batch[:3])
        odd = ""
    except ValueError as err:
        odd = str(err)
    counts = torch.full((2,), rank + 1, dtype=torch.int32)
    ctx.sum_counts(counts)
    said = ctx.broadcast_str("from rank 0: ünïcode" if rank == 0 else "ignored")
    return {"rows": rows, "loss": ctx.global_loss(torch.tensor(float(rank))), "counts": counts,
            "odd_batch_refused": torch.tensor("does not split over dp=2" in odd),
            "broadcast_str": torch.tensor(said == "from rank 0: ünïcode"),
            "broadcast_int": torch.tensor(ctx.broadcast_int(10 + rank)), "main": torch.tensor(ctx.is_main)}


def _check_context(outs):
    """The distributed context splits the batch and agrees on values."""
    for rank, out in enumerate(outs):
        assert torch.equal(out["context.rows"], torch.arange(12).view(4, 3)[2 * rank:2 * rank + 2])
        assert float(out["context.loss"]) == 0.5                      # the mean over the dp ranks
        assert out["context.counts"].tolist() == [3, 3]               # summed over every rank
        assert bool(out["context.odd_batch_refused"]) and bool(out["context.broadcast_str"])
        assert int(out["context.broadcast_int"]) == 10 and bool(out["context.main"]) == (rank == 0)


def test_the_single_process_context_changes_nothing():
    from kimik3.parallel.context import ParallelContext, training_context
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import TrainArgs, Trainer

    ctx = training_context(torch.device("cpu"))
    assert type(ctx) is ParallelContext and ctx.is_main and ctx.can_generate
    batch = torch.arange(6).view(2, 3)
    assert ctx.shard_batch(batch)[0] is batch and ctx.shard_sequence(batch)[0] is batch
    loss = torch.tensor(2.5, requires_grad=True)
    assert ctx.backward_loss(loss) is loss and ctx.global_loss(loss) is loss
    assert ctx.broadcast_int(7) == 7 and ctx.broadcast_str("x") == "x"
    counts = torch.ones(3)
    ctx.sum_counts(counts)
    assert counts.tolist() == [1.0, 1.0, 1.0]
    with ctx.main_first():
        ctx.barrier()
    assert ctx.full_model_state(torch.nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="dp=2 x cp=1 = 2 ranks, but the world has 1"):
        ParallelContext(torch.device("cpu"), ParallelDims(dp=2))
    with pytest.raises(ValueError, match="not both"):
        Trainer(TrainArgs(), parallel=ParallelDims(dp=1), context=ctx)


# ---------------------------------------------------------------------------- Muon under FSDP2
def _muon_case(rank, world):
    """One Muon + AdamW step on the small test model sharded with FSDP2, from the same full gradients."""
    from torch.distributed.tensor import distribute_tensor

    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.optim import build_param_groups
    from kimik3.parallel.fsdp import apply_fsdp
    from kimik3.parallel.mesh import ParallelDims, build_mesh, fsdp_mesh

    model = K3ForCausalLM(small_config(), seed=0)
    grads = _fixed_grads(model)
    apply_fsdp(model, fsdp_mesh(build_mesh(ParallelDims(dp=world), "cpu")))
    optimizer = build_param_groups(model, lr=1e-2)
    for _ in range(2):  # the second step sees a momentum buffer
        for name, p in model.named_parameters():
            p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements, src_data_rank=None)
        optimizer.step()
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def _fixed_grads(model):
    generator = torch.Generator().manual_seed(1)
    return {name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}


def _check_muon(outs):
    """Muon under FSDP2 gives the single-process update."""
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.optim import build_param_groups

    model = K3ForCausalLM(small_config(), seed=0)
    grads = _fixed_grads(model)
    optimizer = build_param_groups(model, lr=1e-2)
    for _ in range(2):
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        optimizer.step()
    for name, p in model.named_parameters():
        # Same input to the same (bf16) Newton-Schulz on every rank: equal up to matmul threading.
        torch.testing.assert_close(outs[0][f"muon.{name}"], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(outs[0][f"muon.{name}"], outs[1][f"muon.{name}"]), name


def _shard_layout_case(rank, world):
    """Which sharded parameters Muon may orthogonalise shard-locally, and the collectives one step makes."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from kimik3.optim import Muon
    from kimik3.optim.sharded import shard_layout
    from kimik3.parallel.mesh import ParallelDims, build_mesh, fsdp_mesh

    mesh = fsdp_mesh(build_mesh(ParallelDims(dp=world), "cpu"))
    cases = {  # name: (shape, split, placement)
        "experts": ((4, 3, 5), ("experts",), Shard(0)),
        "rows_4_heads": ((8, 6), ("rows", 4), Shard(0)),       # 2 rows per head, 4 per rank: aligned
        "rows_3_heads": ((6, 4), ("rows", 3), Shard(0)),       # 2 rows per head, 3 per rank: not aligned
        "whole": ((8, 6), ("whole",), Shard(0)),
        "cols": ((8, 6), ("cols", 2), Shard(0)),
        "replicated_whole": ((8, 6), ("whole",), Replicate()),
        "sharded_dim1": ((4, 3, 5), ("experts",), Shard(1)),   # not a layout Muon takes: a clear error
    }
    out = {}
    for name, (shape, split, placement) in cases.items():
        p = distribute_tensor(torch.zeros(shape), mesh, [placement], src_data_rank=None)
        try:
            layout = shard_layout(split, p, name)
        except ValueError:
            out[name] = torch.tensor(-2)
            continue
        out[name] = torch.tensor(-1 if layout is None else layout.blocks)

    # One Muon step: only the parameters whose blocks cross shards are exchanged, all of them in two
    # all-to-alls (their rows to the rank orthogonalising them, its results' rows back; "whole_7x6" has
    # uneven shards, 4 and 3 rows); no all-gather, no full_tensor; the result is one process's step.
    import torch.distributed as dist

    shapes = {"experts": ((4, 3, 5), ("experts",)), "rows_4_heads": ((8, 6), ("rows", 4)),
              "whole": ((8, 6), ("whole",)), "whole_7x6": ((7, 6), ("whole",))}
    gen = torch.Generator().manual_seed(0)
    full = {n: (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for n, (shape, _) in shapes.items()}
    params = {n: torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)], src_data_rank=None))
              for n, (w, _) in full.items()}
    plain = {n: torch.nn.Parameter(w.clone()) for n, (w, _) in full.items()}
    optimizers = [Muon([{"params": [ps[n]], "split": shapes[n][1], "param_names": [n]} for n in shapes], lr=0.1)
                  for ps in (params, plain)]
    for n, (_, g) in full.items():
        params[n].grad = distribute_tensor(g.clone(), mesh, [Shard(0)], src_data_rank=None)
        plain[n].grad = g.clone()
    calls = []
    originals = DTensor.full_tensor, dist.all_gather_into_tensor, dist.all_to_all_single
    DTensor.full_tensor = lambda self, *a, **k: (calls.append("full_tensor"), originals[0](self, *a, **k))[1]
    dist.all_gather_into_tensor = lambda *a, **k: (calls.append("all_gather"), originals[1](*a, **k))[1]
    dist.all_to_all_single = lambda *a, **k: (calls.append("all_to_all"), originals[2](*a, **k))[1]
    try:
        optimizers[0].step()
    finally:
        DTensor.full_tensor, dist.all_gather_into_tensor, dist.all_to_all_single = originals
    optimizers[1].step()
    out["calls"] = torch.tensor([len(calls), calls.count("all_to_all")])
    for n in shapes:
        out[f"sharded.{n}"], out[f"plain.{n}"] = params[n].full_tensor(), plain[n].detach()
    return out


def _check_shard_layout(outs):
    """Expert stacks and head-aligned row blocks are orthogonalised on the local shard (no exchange);
    matrices whose blocks cross shards go through two all-to-alls together; other layouts are refused; every
    update equals one process's Muon step."""
    for out in outs:
        out = {k.removeprefix("layout."): v for k, v in out.items() if k.startswith("layout.")}
        blocks = {k: int(v) for k, v in out.items() if k in ("experts", "rows_4_heads", "rows_3_heads", "whole",
                                                               "cols", "replicated_whole", "sharded_dim1")}
        assert blocks == {"experts": 2, "rows_4_heads": 2, "rows_3_heads": -1, "whole": -1, "cols": -1,
                          "replicated_whole": 1, "sharded_dim1": -2}, blocks
        assert out["calls"].tolist() == [2, 2]  # both "whole" matrices in the same two all-to-alls
        for name in ("experts", "rows_4_heads", "whole", "whole_7x6"):
            assert torch.equal(out[f"sharded.{name}"], out[f"plain.{name}"]), name


# ---------------------------------------------------------------------------- checkpointing, fp32 islands
def _batch(vocab_size):
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab_size, (2, 33), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def _parallelize_case(rank, world):
    """Activation checkpointing + FSDP2 on one half of a batch each; fp32 islands."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.parallel.apply import parallelize
    from kimik3.parallel.fsdp import apply_fsdp
    from kimik3.parallel.mesh import ParallelDims, balance_group, build_mesh, fsdp_mesh
    from kimik3.train.balance import QuantileBalancer

    dims = ParallelDims(dp=world)
    mesh = build_mesh(dims, "cpu")
    config = small_config()
    model = K3ForCausalLM(config, seed=0)
    parallelize(model, dims, mesh, activation_checkpointing=True)
    group = balance_group(mesh)
    balancer = QuantileBalancer(model.routers(), all_reduce=lambda t: torch.distributed.all_reduce(t, group=group))
    inputs, labels = _batch(config.vocab_size)
    out = model(inputs[rank:rank + 1], labels=labels[rank:rank + 1])
    balancer.observe(out.routing)
    loss = out.loss
    loss.backward()
    local_routed = balancer.loads(0).sum().clone()  # before step()'s all-reduce: this rank's tokens only
    result = {"loss": loss.detach(), "routed": local_routed}
    result.update({name: p.grad.full_tensor() for name, p in model.named_parameters() if name in _GRADS})

    # bf16 compute copies, but A_log / dt_bias reach the KDA forward in fp32.
    cast = K3ForCausalLM(config, seed=0)
    apply_fsdp(cast, fsdp_mesh(mesh), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                      reduce_dtype=torch.float32))
    seen = {}
    kda = cast.layers[0].mixer
    kda.register_forward_pre_hook(lambda m, args: seen.update(a_log=m.A_log.dtype, dt_bias=m.dt_bias.dtype))
    kda.q_proj.register_forward_pre_hook(lambda m, args: seen.update(q=m.weight.dtype))
    with torch.no_grad():
        cast(inputs[rank:rank + 1])
    result["dtypes_ok"] = torch.tensor(seen == {"a_log": torch.float32, "dt_bias": torch.float32, "q": torch.bfloat16})
    if not bool(result["dtypes_ok"]):
        print("dtypes seen", seen)
    return result


_GRADS = ("embed.weight", "layers.1.mixer.q_proj.weight", "layers.1.ffn.experts.w_up_ELF")


def _check_parallelize(outs):
    """Activation checkpointing + FSDP2 give the single-process loss and gradients; fp32 islands."""
    from kimik3.model.k3 import K3ForCausalLM

    config = small_config()
    model = K3ForCausalLM(config, seed=0)
    inputs, labels = _batch(config.vocab_size)
    loss = model(inputs, labels=labels).loss
    loss.backward()
    grads = dict(model.named_parameters())
    torch.testing.assert_close((outs[0]["parallelize.loss"] + outs[1]["parallelize.loss"]) / 2, loss.detach(),
                               rtol=1e-5, atol=0)
    for name in _GRADS:
        torch.testing.assert_close(outs[0][f"parallelize.{name}"], grads[name].grad, rtol=1e-4, atol=1e-7, msg=name)
    # Recomputation in backward re-runs the routers; the balancer still counts each token once.
    assert [int(o["parallelize.routed"]) for o in outs] == [32 * config.moe.top_k] * 2
    assert all(bool(o["parallelize.dtypes_ok"]) for o in outs)


# ---------------------------------------------------------------------------- the command line
def test_cli_nproc_2_trains_end_to_end(config_path, corpus, tmp_path):
    """`kimik3 train --nproc 2` relaunches itself through torchrun (evaluation and sample included)."""
    out = tmp_path / "cli"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "kimik3", "train", "--nproc", "2", "--steps", "2",
                             "--config", str(config_path), "--data", str(corpus), "--seq-len", "64",
                             "--batch-size", "4", "--out", str(out), "--no-progress"],
                            check=False, capture_output=True, text=True, env=env, timeout=600,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and "val_loss" in records[-1]
    # Two ranks write a sharded checkpoint (each its own shards), which the run directory links to.
    assert (out / "kimik3_dcp.json").is_file() and has_weights(out) and (out / "loss.png").is_file()
    assert result.stdout.count("final train loss") == 1  # rank 0 alone logs
    assert result.stdout.count("sample (temperature") == 1
