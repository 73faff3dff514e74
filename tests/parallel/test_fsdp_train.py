"""Distributed data-parallel training (FSDP2, gloo) through the real trainer, against single-process runs.

Reference: one single-process run of 4 steps. The dp=2 runs must reproduce its losses (the global
batch of a step is the single-process batch; only reduction order differs), and checkpoints cross
between the two kinds of run in both directions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.corpus import write_code_corpus
from tests.parallel.gloo import run_ranks

RTOL = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_code_corpus(tmp_path_factory.mktemp("corpus"), 40)


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


def _args(corpus, out, **changes):
    from kimik3.train.trainer import TrainArgs

    base = dict(preset="tiny", data=str(corpus), steps=4, out=str(out), seq_len=64, batch_size=4,
                eval_every=100, eval_windows=2, checkpoint_every=2, progress=False, lr=3e-3)
    base.update(changes)
    return TrainArgs(**base)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _fast(trainer_cls):
    """Skip the end-of-run sample and evaluation (tens of seconds on 2 shared cores; the CLI test
    below runs them under FSDP). Training, checkpoints and metrics are untouched."""
    trainer_cls.sample = lambda self, prompt, max_new_tokens=80: ""
    trainer_cls.evaluate = lambda self: 0.0


def _crash_after(step):
    def on_step(record):
        if record["step"] == step:
            raise KeyboardInterrupt
    return on_step


def _train_worker(rank, world, corpus, out, resume, crash_after, ep=1, cp=1):
    """One rank of dp = world / cp (expert parallel over ep of them, context parallel over cp):
    train (or resume) the 4-step run; returns the losses it logged."""
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import TrainArgs, Trainer

    _fast(Trainer)
    dims = ParallelDims(dp=world // cp, ep=ep, cp=cp)
    if resume:
        trainer = Trainer(TrainArgs(progress=False), resume=out, log=lambda _: None, parallel=dims)
    else:
        trainer = Trainer(_args(corpus, out), log=lambda _: None, parallel=dims)
    history = []
    try:
        trainer.run(on_step=lambda r: (history.append(r["loss"]),
                                       crash_after is not None and _crash_after(crash_after)(r)))
    except KeyboardInterrupt:
        pass
    return {"losses": torch.tensor(history, dtype=torch.float64)}


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
def reference(corpus, tmp_path_factory):
    from kimik3.train.trainer import Trainer

    out = tmp_path_factory.mktemp("runs") / "single"
    Trainer(_args(corpus, out), log=lambda _: None).run()
    return _losses(out)


def _close(found, expected):
    torch.testing.assert_close(torch.tensor(found, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=RTOL, atol=0)


def test_dp2_matches_single_process_and_its_checkpoint_resumes_single_process(reference, corpus, tmp_path):
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.train.trainer import TrainArgs, Trainer

    out = tmp_path / "dp2"
    # Interrupted after 3 steps (checkpoint at step 2, as checkpoint_every=2).
    outs = run_ranks(_train_worker, 2, tmp_path, str(corpus), str(out), False, 2)
    assert torch.equal(outs[0]["losses"], outs[1]["losses"])  # every rank logs the same global loss
    _close(outs[0]["losses"].tolist(), reference[:3])
    assert _losses(out) == outs[0]["losses"].tolist()  # rank 0 wrote the metrics
    assert json.loads((out / "train_state.json").read_text())["step"] == 2
    K3ForCausalLM.from_pretrained(out)  # full tensors, readable by a single process

    Trainer(TrainArgs(progress=False), resume=out, log=lambda _: None).run()
    _close(_losses(out), reference)


def test_single_process_checkpoint_resumes_under_dp2(reference, corpus, tmp_path):
    from kimik3.train.trainer import Trainer

    out = tmp_path / "single"
    with pytest.raises(KeyboardInterrupt):
        Trainer(_args(corpus, out), log=lambda _: None).run(on_step=_crash_after(2))
    outs = run_ranks(_train_worker, 2, tmp_path, str(corpus), str(out), True, None)
    _close(outs[0]["losses"].tolist(), reference[2:])
    _close(_losses(out), reference)


def test_ep2_matches_single_process_and_its_checkpoint_resumes_single_process(reference, corpus, tmp_path):
    """dp=2 with the experts split over the same 2 ranks (MoonEP exchange, perfectly balanced)."""
    from kimik3.train.trainer import TrainArgs, Trainer

    out = tmp_path / "ep2"
    outs = run_ranks(_train_worker, 2, tmp_path, str(corpus), str(out), False, 2, 2)
    assert torch.equal(outs[0]["losses"], outs[1]["losses"])
    _close(outs[0]["losses"].tolist(), reference[:3])
    Trainer(TrainArgs(progress=False), resume=out, log=lambda _: None).run()   # the gathered experts load
    _close(_losses(out), reference)


def test_cp2_matches_single_process(reference, corpus, tmp_path):
    """Each sequence split over 2 ranks (KDA context parallelism: one state all-gather per layer)."""
    outs = run_ranks(_train_worker, 2, tmp_path, str(corpus), str(tmp_path / "cp2"), False, 2, 1, 2)
    assert torch.equal(outs[0]["losses"], outs[1]["losses"])
    _close(outs[0]["losses"].tolist(), reference[:3])


def test_dp2_ep2_cp2_on_four_ranks_matches_single_process(reference, corpus, tmp_path):
    """All three at once (4 gloo ranks): 2 data-parallel groups, experts over the 2 dp ranks, each
    sequence over 2 cp ranks (EP weight gradients then also sum over the 2 cp replicas)."""
    outs = run_ranks(_train_worker, 4, tmp_path, str(corpus), str(tmp_path / "mix"), False, 2, 2, 2)
    assert all(torch.equal(outs[0]["losses"], o["losses"]) for o in outs)
    _close(outs[0]["losses"].tolist(), reference[:3])


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


def _muon_worker(rank, world):
    """One Muon + AdamW step on a tiny model sharded with FSDP2, from the same full gradients."""
    from torch.distributed.tensor import distribute_tensor

    from kimik3.config.schema import K3Config
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.optim import build_param_groups
    from kimik3.parallel.fsdp import apply_fsdp
    from kimik3.parallel.mesh import ParallelDims, build_mesh, fsdp_mesh

    model = K3ForCausalLM(K3Config.preset("tiny"), seed=0)
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


def test_muon_under_fsdp_gives_the_single_process_update(tmp_path):
    from kimik3.config.schema import K3Config
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.optim import build_param_groups

    outs = run_ranks(_muon_worker, 2, tmp_path)
    model = K3ForCausalLM(K3Config.preset("tiny"), seed=0)
    grads = _fixed_grads(model)
    optimizer = build_param_groups(model, lr=1e-2)
    for _ in range(2):
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        optimizer.step()
    for name, p in model.named_parameters():
        # Same input to the same (bf16) Newton-Schulz on every rank: equal up to matmul threading.
        torch.testing.assert_close(outs[0][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(outs[0][name], outs[1][name]), name


def _shard_layout_worker(rank, world):
    """Which sharded parameters Muon may orthogonalise shard-locally, and the gathers one step makes."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from kimik3.optim import Muon
    from kimik3.optim.muon import _shard_layout
    from kimik3.parallel.mesh import ParallelDims, build_mesh, fsdp_mesh

    mesh = fsdp_mesh(build_mesh(ParallelDims(dp=world), "cpu"))
    cases = {  # name: (shape, split, placement)
        "experts": ((4, 3, 5), ("experts",), Shard(0)),
        "rows_4_heads": ((8, 6), ("rows", 4), Shard(0)),       # 2 rows per head, 4 per rank: aligned
        "rows_3_heads": ((6, 4), ("rows", 3), Shard(0)),       # 2 rows per head, 3 per rank: not aligned
        "whole": ((8, 6), ("whole",), Shard(0)),
        "cols": ((8, 6), ("cols", 2), Shard(0)),
        "replicated_whole": ((8, 6), ("whole",), Replicate()),
        "sharded_dim1": ((4, 3, 5), ("experts",), Shard(1)),
    }
    out = {}
    for name, (shape, split, placement) in cases.items():
        p = distribute_tensor(torch.zeros(shape), mesh, [placement], src_data_rank=None)
        layout = _shard_layout(split, p, name)
        out[name] = torch.tensor(-1 if layout is None else layout.blocks)

    # One Muon step: only the parameters whose blocks cross shards are gathered, together (one
    # all-gather; "whole_7x6" has uneven shards, 4 and 3 rows), and the result is one process's step;
    # with a 1-byte bucket, one all-gather each.
    import torch.distributed as dist

    import kimik3.optim.muon as muon_module

    shapes = {"experts": ((4, 3, 5), ("experts",)), "rows_4_heads": ((8, 6), ("rows", 4)),
              "whole": ((8, 6), ("whole",)), "whole_7x6": ((7, 6), ("whole",))}
    gen = torch.Generator().manual_seed(0)
    full = {n: (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for n, (shape, _) in shapes.items()}
    for tag, bucket in (("", muon_module.GATHER_BUCKET_BYTES), ("tiny_bucket.", 1)):
        muon_module.GATHER_BUCKET_BYTES = bucket
        params = {n: torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)], src_data_rank=None))
                  for n, (w, _) in full.items()}
        plain = {n: torch.nn.Parameter(w.clone()) for n, (w, _) in full.items()}
        optimizers = [Muon([{"params": [ps[n]], "split": shapes[n][1], "param_names": [n]} for n in shapes], lr=0.1)
                      for ps in (params, plain)]
        for n, (_, g) in full.items():
            params[n].grad = distribute_tensor(g.clone(), mesh, [Shard(0)], src_data_rank=None)
            plain[n].grad = g.clone()
        calls = []
        originals = DTensor.full_tensor, dist.all_gather_into_tensor
        DTensor.full_tensor = lambda self, *a, **k: (calls.append("full_tensor"), originals[0](self, *a, **k))[1]
        dist.all_gather_into_tensor = lambda *a, **k: (calls.append("all_gather"), originals[1](*a, **k))[1]
        try:
            optimizers[0].step()
        finally:
            DTensor.full_tensor, dist.all_gather_into_tensor = originals
        optimizers[1].step()
        out[f"{tag}calls"] = torch.tensor([len(calls), calls.count("all_gather")])
        for n in shapes:
            out[f"{tag}sharded.{n}"], out[f"{tag}plain.{n}"] = params[n].full_tensor(), plain[n].detach()
    return out


def test_muon_orthogonalises_shard_locally_when_blocks_allow(tmp_path):
    """Expert stacks and head-aligned row blocks are orthogonalised on the local shard (no all-gather);
    matrices whose blocks cross shards are gathered, all in one all-gather; every update equals one
    process's Muon step."""
    outs = run_ranks(_shard_layout_worker, 2, tmp_path)
    for out in outs:
        blocks = {k: int(v) for k, v in out.items() if k in ("experts", "rows_4_heads", "rows_3_heads", "whole",
                                                               "cols", "replicated_whole", "sharded_dim1")}
        assert blocks == {"experts": 2, "rows_4_heads": 2, "rows_3_heads": -1, "whole": -1, "cols": -1,
                          "replicated_whole": 1, "sharded_dim1": -1}, blocks
        assert out["calls"].tolist() == [1, 1]  # both "whole" matrices in one all-gather, no full_tensor
        assert out["tiny_bucket.calls"].tolist() == [2, 2]  # one bucket each
        for tag in ("", "tiny_bucket."):
            for name in ("experts", "rows_4_heads", "whole", "whole_7x6"):
                torch.testing.assert_close(out[f"{tag}sharded.{name}"], out[f"{tag}plain.{name}"], rtol=1e-5,
                                           atol=1e-6, msg=tag + name)


def test_cli_nproc_2_trains_end_to_end(corpus, tmp_path):
    """`kimik3 train --nproc 2` relaunches itself through torchrun (evaluation and sample included)."""
    out = tmp_path / "cli"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "kimik3", "train", "--nproc", "2", "--steps", "2",
                             "--data", str(corpus), "--seq-len", "64", "--batch-size", "4", "--out", str(out),
                             "--no-progress"], check=False, capture_output=True, text=True, env=env, timeout=600,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(_losses(out)) == 2
    assert (out / "model.safetensors").is_file() and (out / "loss.png").is_file()
    assert result.stdout.count("final train loss") == 1  # rank 0 alone logs


def _batch():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 4096, (2, 33), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def _parallelize_worker(rank, world):
    """Activation checkpointing + FSDP2 on one half of a batch each; fp32 islands; EP's placeholder."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from kimik3.config.schema import K3Config
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.parallel.apply import parallelize
    from kimik3.parallel.fsdp import apply_fsdp
    from kimik3.parallel.mesh import ParallelDims, balance_group, build_mesh, fsdp_mesh
    from kimik3.train.balance import QuantileBalancer

    dims = ParallelDims(dp=world)
    mesh = build_mesh(dims, "cpu")
    model = K3ForCausalLM(K3Config.preset("tiny"), seed=0)
    parallelize(model, dims, mesh, activation_checkpointing=True)
    group = balance_group(mesh)
    balancer = QuantileBalancer(model.routers(), all_reduce=lambda t: torch.distributed.all_reduce(t, group=group))
    inputs, labels = _batch()
    out = model(inputs[rank:rank + 1], labels=labels[rank:rank + 1])
    balancer.observe(out.routing)
    loss = out.loss
    loss.backward()
    local_routed = balancer.loads(0).sum().clone()  # before step()'s all-reduce: this rank's tokens only
    out = {"loss": loss.detach(), "routed": local_routed}
    out.update({name: p.grad.full_tensor() for name, p in model.named_parameters()
                if name in ("embed.weight", "layers.1.mixer.q_proj.weight", "layers.1.ffn.experts.w_up_ELF")})

    # bf16 compute copies, but A_log / dt_bias reach the KDA forward in fp32.
    cast = K3ForCausalLM(K3Config.preset("tiny"), seed=0)
    apply_fsdp(cast, fsdp_mesh(mesh), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                      reduce_dtype=torch.float32))
    seen = {}
    kda = cast.layers[0].mixer
    kda.register_forward_pre_hook(lambda m, args: seen.update(a_log=m.A_log.dtype, dt_bias=m.dt_bias.dtype))
    kda.q_proj.register_forward_pre_hook(lambda m, args: seen.update(q=m.weight.dtype))
    with torch.no_grad():
        cast(inputs[rank:rank + 1])
    out["dtypes_ok"] = torch.tensor(seen == {"a_log": torch.float32, "dt_bias": torch.float32, "q": torch.bfloat16})
    if not bool(out["dtypes_ok"]):
        print("dtypes seen", seen)

    return out


def test_parallelize_checkpointing_fsdp_and_fp32_islands(tmp_path):
    from kimik3.config.schema import K3Config
    from kimik3.model.k3 import K3ForCausalLM

    outs = run_ranks(_parallelize_worker, 2, tmp_path)
    model = K3ForCausalLM(K3Config.preset("tiny"), seed=0)
    inputs, labels = _batch()
    loss = model(inputs, labels=labels).loss
    loss.backward()
    grads = dict(model.named_parameters())
    torch.testing.assert_close((outs[0]["loss"] + outs[1]["loss"]) / 2, loss.detach(), rtol=1e-5, atol=0)
    for name in ("embed.weight", "layers.1.mixer.q_proj.weight", "layers.1.ffn.experts.w_up_ELF"):
        torch.testing.assert_close(outs[0][name], grads[name].grad, rtol=1e-4, atol=1e-7, msg=name)
    top_k = model.config.moe.top_k
    # Recomputation in backward re-runs the routers; the balancer still counts each token once.
    assert [int(o["routed"]) for o in outs] == [32 * top_k, 32 * top_k]
    assert all(bool(o["dtypes_ok"]) for o in outs)
