"""`kimik3 rl`: advantages, the clipped objective, on-policy ratios, weight sync, runs end to end, resume, CLI."""

import json
import math

import numpy as np
import pytest
import torch

from kimik3.cli import main
from kimik3.model.k3 import K3ForCausalLM
from kimik3.posttrain.policy_loss import clipped_policy_loss, group_advantages, make_batch, token_logprobs
from kimik3.posttrain.rollout import RolloutEngine, rollout_rows
from kimik3.posttrain.tasks import Task, make_tasks
from kimik3.serve.chat import ChatEncoder, load_chat_template
from kimik3.tokenizer import load_tokenizer


def test_group_advantages_normalise_each_group_and_zero_variance_groups_give_nothing():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], 4)
    assert adv[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)     # mean 0.5, std 0.5
    assert adv[4:8] == [0.0] * 4                                         # all solved: no signal
    third = 1 / math.sqrt(3)                                             # mean 0.25, std sqrt(3) / 4
    assert adv[8:] == pytest.approx([-third, -third, math.sqrt(3), -third], abs=1e-5)
    assert group_advantages([0.0, 0.0], 2) == [0.0, 0.0]
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 0.0], 3)


def test_clipped_objective_matches_a_hand_computation():
    new = torch.tensor([[0.0, math.log(1.5), math.log(0.5), 9.0]])
    old = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    for a in (1.0, -1.0):
        parts = clipped_policy_loss(new, old, torch.tensor([a]), mask, clip=0.2)
        # ratios 1, 1.5, 0.5: A > 0 keeps min(r, clip(r)) = 1, 1.2, 0.5; A < 0 keeps -max(r, clip(r)) = -1, -1.5, -0.8
        expected = -(1 + 1.2 + 0.5) / 3 if a > 0 else (1 + 1.5 + 0.8) / 3
        assert float(parts.loss) == pytest.approx(expected)
        assert parts.tokens == 3 and parts.clipped == 1.0      # the ratio the clip held: 1.5 (A > 0), 0.5 (A < 0)
        assert parts.ratio_sum == pytest.approx(3.0) and parts.ratio_max_dev == pytest.approx(0.5)
    # KL (k3 estimator) to a reference, weighted in; the gradient of the clipped tokens is zero.
    ref = torch.tensor([[math.log(2.0), 0.0, 0.0, 0.0]])
    new.requires_grad_(True)
    parts = clipped_policy_loss(new, old, torch.tensor([1.0]), mask, 0.2, ref=ref, kl_coef=0.5)
    kl = [2.0 - math.log(2.0) - 1, 1 / 1.5 + math.log(1.5) - 1, 2.0 + math.log(0.5) - 1]
    assert float(parts.loss.detach()) == pytest.approx(-(1 + 1.2 + 0.5) / 3 + 0.5 * sum(kl) / 3, rel=1e-5)
    parts.loss.backward()
    assert new.grad[0, 3] == 0      # off the mask
    assert float(new.grad[0, 1]) == pytest.approx(0.5 * (1 - 1 / 1.5) / 3, rel=1e-5)  # clipped: only the KL's


@pytest.fixture(scope="module")
def policy_parts(base_run):
    tokenizer = load_tokenizer(base_run / "tokenizer.json", vocab_size=640)
    encoder = ChatEncoder(tokenizer, load_chat_template(None, base_run))
    return tokenizer, encoder


def _rollouts(engine, n=3, seed=1, temperature=1.0):
    tasks = make_tasks("general", "train", n, 0, "low")
    return engine.rollouts(tasks, seed=seed, temperature=temperature, max_tokens=24)[0]


def _recomputed(policy, rollouts, temperature=1.0):
    prompts, completions, logprobs, _ = rollout_rows(rollouts, [1.0] * len(rollouts))
    batch = make_batch(prompts, completions, logprobs, [1.0] * len(prompts))
    device = next(policy.parameters()).device
    with torch.no_grad():
        new = token_logprobs(policy.eval(), batch.input_ids.to(device), batch.targets.to(device), temperature)
    return new.float().cpu()[batch.mask], batch.old[batch.mask]


def test_rollouts_at_a_temperature_carry_the_tempered_log_probabilities(base_run, policy_parts):
    """At temperature 0.6 the rollout's log-probabilities are the policy's at 0.6 (ratio 1), not its untempered
    ones: the importance ratios compare the distribution that sampled with the one trained."""
    tokenizer, encoder = policy_parts
    policy = K3ForCausalLM.from_pretrained(base_run, dtype=torch.float32)
    rollout = RolloutEngine(policy, tokenizer, encoder)
    try:
        rollouts = _rollouts(rollout, temperature=0.6)
    finally:
        rollout.close()
    new, old = _recomputed(policy, rollouts, temperature=0.6)
    assert new.numel() > 20 and torch.allclose(new, old, atol=2e-4)
    untempered, _ = _recomputed(policy, rollouts)
    assert (untempered - old).abs().max() > 1e-2


def test_ratio_is_one_on_policy_and_the_engine_serves_the_synced_weights(base_run, policy_parts):
    tokenizer, encoder = policy_parts
    policy = K3ForCausalLM.from_pretrained(base_run, dtype=torch.float32)
    rollout = RolloutEngine(policy, tokenizer, encoder)
    try:
        rollouts = _rollouts(rollout)
        assert all(len(lp) == len(ids) for r in rollouts for lp, ids in zip(r.logprobs, r.token_ids))
        new, old = _recomputed(policy, rollouts)
        assert new.numel() > 20 and torch.allclose(new, old, atol=2e-4)   # ratio exp(new - old) = 1
        greedy_before = [r.token_ids for r in _rollouts(rollout, temperature=0.0)]
        with torch.no_grad():   # an "update": the engine must serve it after sync, not before
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        assert [r.token_ids for r in _rollouts(rollout, temperature=0.0)] == greedy_before
        rollout.sync(policy)
        after = _rollouts(rollout)
        new, old = _recomputed(policy, after)
        assert torch.allclose(new, old, atol=2e-4)
        greedy_after = [r.token_ids for r in _rollouts(rollout, temperature=0.0)]
        assert greedy_after != greedy_before
    finally:
        rollout.close()
    fresh = RolloutEngine(policy, tokenizer, encoder)   # an engine built from the updated weights agrees
    try:
        assert [r.token_ids for r in _rollouts(fresh, temperature=0.0)] == greedy_after
    finally:
        fresh.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_serves_the_fp32_policy_in_bf16_with_graphs(base_run, policy_parts):
    """On CUDA the policy trains in fp32 under bf16 autocast; the engine holds bf16 weights (its captured graphs
    take the bf16 MoE path) kept equal to the policy's by sync, and its log-probabilities are the policy's
    under autocast up to bf16 rounding."""
    from kimik3.config.schema import K3Config
    from kimik3.posttrain.rollout import rollout_dtype

    tokenizer, encoder = policy_parts
    spec = K3ForCausalLM.from_pretrained(base_run).config.to_dict()
    spec["mla"].update(qk_rope_head_dim=16)   # the widths the CUDA decode kernel takes
    policy = K3ForCausalLM(K3Config.from_dict(spec), device="cuda", dtype=torch.float32, seed=0)
    assert rollout_dtype(next(policy.parameters())) == torch.bfloat16
    rollout = RolloutEngine(policy, tokenizer, encoder)
    try:
        assert rollout.model.dtype == torch.bfloat16
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        rollout.sync(policy)
        for name, held in rollout.model.state_dict().items():
            source = policy.state_dict()[name]
            assert torch.equal(held, source.to(held.dtype)), name
        rollouts = _rollouts(rollout)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            new, old = _recomputed(policy, rollouts)
        gap = (new - old).abs()
        assert new.numel() > 20 and gap.mean() < 0.05 and gap.max() < 0.5
    finally:
        rollout.close()


def test_qat_stays_on_in_rollouts(base_run, policy_parts, tmp_path):
    """With MXFP4 experts the engine serves them packed; after a sync its log-probabilities are the fake-quantised
    policy's."""
    import dataclasses

    tokenizer, encoder = policy_parts
    plain = K3ForCausalLM.from_pretrained(base_run, dtype=torch.float32).config
    config = dataclasses.replace(plain, moe=dataclasses.replace(plain.moe, expert_quant="mxfp4", latent_dim=32))
    policy = K3ForCausalLM(config, dtype=torch.float32, seed=0)
    rollout = RolloutEngine(policy, tokenizer, encoder)
    try:
        assert any(getattr(m, "packed", None) is not None for m in rollout.model.modules())
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        rollout.sync(policy)
        new, old = _recomputed(policy, _rollouts(rollout, n=2))
        assert torch.allclose(new, old, atol=2e-3)
    finally:
        rollout.close()


@pytest.fixture
def some_reward(monkeypatch):
    """Rewards with variance within groups (an untrained model solves nothing): completions of even length win."""
    monkeypatch.setattr(Task, "score",
                        lambda self, completion, reasoning_tokens=None: float(len(completion) % 2 == 0))


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_rl_runs_end_to_end_resumes_and_writes_a_loadable_run(base_run, tmp_path, some_reward, capsys):
    out = tmp_path / "rl"
    common = ["--iterations", "2", "--group", "2", "--prompts", "2", "--max-tokens", "24", "--checkpoint-every", "1",
              "--no-progress"]
    assert main(["rl", "--run", str(base_run), "--domain", "general", "--effort", "low", "--out", str(out),
                 "--lr", "1e-2", *common]) == 0
    printed = capsys.readouterr().out
    assert "iteration 1: reward" in printed and "tok/s" in printed
    records = _records(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["rollout_tokens_per_s"] > 0 and 0 <= r["reward_mean"] <= 1 and r["completion_tokens"] > 0
    assert any(r["optimizer_steps"] > 0 and r["trained_tokens"] > 0 for r in records)
    assert all(r["ratio_max_dev"] < 1e-2 for r in records)      # the first minibatch is on-policy
    for name in ("model.safetensors", "config.json", "tokenizer.json", "rl.json", "rl.png", "run.json"):
        assert (out / name).is_file(), name
    changed = K3ForCausalLM.from_pretrained(out).state_dict()
    start = K3ForCausalLM.from_pretrained(base_run).state_dict()
    assert any(not torch.equal(changed[k], start[k]) for k in start)
    # Resume to 3 iterations: the third record is appended, the first two kept.
    assert main(["rl", "--resume", str(out), "--iterations", "3", "--checkpoint-every", "1", "--no-progress"]) == 0
    assert [r["step"] for r in _records(out)] == [0, 1, 2]
    assert _records(out)[:2] == records
    # The output is a run like any other: eval-tasks loads it.
    capsys.readouterr()
    assert main(["eval-tasks", "--run", str(out), "--domain", "general", "--effort", "low", "--n", "2",
                 "--max-tokens", "4", "--no-progress"]) == 0
    assert "general/low: " in capsys.readouterr().out


def test_rl_agents_with_kl_to_the_reference(base_run, tmp_path, some_reward):
    from kimik3.posttrain.rl import run_rl

    records = run_rl(base_run, domain="agents", effort="low", iterations=1, group=2, prompts=1, lr=1e-2,
                     kl_coef=0.1, minibatches=2, max_tokens=16, out=tmp_path / "rl", progress=False,
                     log=lambda _: None)
    (record,) = records
    if record["optimizer_steps"] == 2:   # the second minibatch trains a policy the first one moved
        assert record["kl"] >= 0


def test_epochs_repeat_the_minibatches(base_run, tmp_path, some_reward):
    import dataclasses

    from kimik3.posttrain.rl import RLSpec, run_rl

    records = run_rl(base_run, domain="general", effort="low", iterations=2, group=2, prompts=2, lr=1e-2,
                     minibatches=1, epochs=3, max_tokens=16, out=tmp_path / "rl", progress=False, log=lambda _: None)
    assert all(r["optimizer_steps"] in (0, 3) for r in records) and any(r["optimizer_steps"] == 3 for r in records)
    assert all(r["ratio_max_dev"] < 1e-2 for r in records)      # the first pass's first minibatch is on-policy
    one = RLSpec("runs/x", "general", "low")    # one pass hashes as before (test_partial_rollouts checks it)
    assert dataclasses.replace(one, epochs=2).fingerprint != one.fingerprint
    with pytest.raises(ValueError, match="--epochs must be >= 1"):
        dataclasses.replace(one, epochs=0).validate()


def test_prompt_pool_visits_a_fixed_set_pass_after_pass():
    import dataclasses

    from kimik3.posttrain.rl import RLSpec, iteration_tasks

    spec = RLSpec("runs/x", "coding", "low", "easy", group=2, prompts=3, prompt_pool=5)
    prompts = [[t.key for t in iteration_tasks(spec, 0, i)] for i in range(5)]
    assert all(p[0::2] == p[1::2] for p in prompts)                 # each prompt twice in a row: one group
    flat = [k for p in prompts for k in p[0::2]]                     # 15 prompts: three passes over the 5
    assert all(len(set(flat[i:i + 5])) == 5 for i in (0, 5, 10)) and len(set(flat)) == 5
    assert flat[:5] != flat[5:10]                                    # each pass in a new order
    fresh = dataclasses.replace(spec, prompt_pool=None)
    assert len({t.key for i in range(5) for t in iteration_tasks(fresh, 0, i)}) > 5
    assert fresh.fingerprint != spec.fingerprint
    with pytest.raises(ValueError, match="--prompt-pool must be >= 1"):
        dataclasses.replace(spec, prompt_pool=0).validate()


def test_a_mixture_takes_its_cells_in_turn_and_one_cell_draws_as_before():
    import dataclasses

    from kimik3.posttrain.rl import RLSpec, iteration_tasks

    mixed = RLSpec("runs/x", "all", "low", "easy", group=2, prompts=4)
    assert mixed.cells == [("general", "low"), ("agents", "low"), ("coding", "low")]
    cells = [[(t.domain, t.effort) for t in iteration_tasks(mixed, 0, i)[0::2]] for i in range(3)]
    # prompt k of iteration s from cell (4 s + k) mod 3
    assert [c for row in cells for c in row] == [mixed.cells[k % 3] for k in range(12)]
    assert len({t.key for i in range(3) for t in iteration_tasks(mixed, 0, i)}) == 12     # no prompt twice
    pooled = dataclasses.replace(mixed, prompt_pool=2)       # two prompts a cell: each cell's pair, pass after pass
    keys = [t.key for i in range(3) for t in iteration_tasks(pooled, 0, i)[0::2]]
    for c in range(3):
        mine = keys[c::3]
        assert len(set(mine)) == 2 and set(mine[:2]) == set(mine[2:4])
    efforts = RLSpec("runs/x", "general", "all", "easy", group=1, prompts=3)
    assert efforts.cells == [("general", e) for e in ("low", "high", "max")]
    problems = [t.key.split("|", 2)[-1] for t in iteration_tasks(efforts, 0, 0)]
    assert len(set(problems)) == 3                                  # the efforts of one domain: other problems
    # one cell: the prompts of the single-cell rule (fresh and pooled), so a run's prompts do not move
    one = RLSpec("runs/x", "coding", "low", "easy", group=1, prompts=3)
    expected = make_tasks("coding", "train", 3, 5 * 1_000_003 + 2, "low", "easy")
    assert [t.key for t in iteration_tasks(one, 5, 2)] == [t.key for t in expected]
    with pytest.raises(ValueError, match="unknown domain 'every'"):
        RLSpec("runs/x", "every", "low").validate()


def test_rl_on_a_mixture_records_each_cell(base_run, tmp_path, some_reward):
    from kimik3.posttrain.mopd import recorded_cell
    from kimik3.posttrain.rl import run_rl

    lines = []
    records = run_rl(base_run, domain="all", effort="low", iterations=1, group=2, prompts=3, lr=1e-2,
                     max_tokens=8, out=tmp_path / "mix", progress=False, eval_n=2, log=lines.append)
    assert any("iteration 0:" in line and "; coding:low reward" in line for line in lines), lines
    (record,) = records
    assert sorted(record["cells"]) == ["agents:low", "coding:low", "general:low"]
    assert all(c["rollouts"] == 2 and c["completion_tokens"] > 0 for c in record["cells"].values())
    assert sorted(record["test_accuracy_cells"]) == sorted(record["test_accuracy_cells_after"]) == sorted(
        record["cells"])
    assert record["test_accuracy"] == pytest.approx(sum(record["test_accuracy_cells"].values()) / 3)
    with pytest.raises(ValueError, match="trained by RL on a mixture"):
        recorded_cell(tmp_path / "mix")


def test_easy_difficulty_and_errors():
    tasks = make_tasks("general", "test", 10, 0, "low", "easy")
    assert all(t.key.startswith("general|easy|") for t in tasks)
    assert tasks[0].score(tasks[0].reference_completion()) == 1.0
    coding = make_tasks("coding", "test", 6, 0, "low", "easy")
    assert all(t.key.startswith(("coding|0|", "coding|1|")) for t in coding)   # x + k, a * x + b
    assert coding[0].score(coding[0].reference_completion()) == 1.0
    standard = {t.key: t.split for t in make_tasks("coding", "test", 300, 0, "low")}
    assert all(standard.get(t.key, "test") == "test" for t in coding)   # an easy task keeps its split
    agents = make_tasks("agents", "test", 20, 0, "low", "easy")
    assert all(t.key.startswith("agents|") and t.key.count(".") == 1 for t in agents)   # one instruction
    assert all(t.score(t.reference_completion()) == 1.0 and t.score("Done.") == 0.0 for t in agents)
    assert not {t.key for t in agents} & {t.key for t in make_tasks("agents", "train", 300, 0, "low", "easy")}
    with pytest.raises(ValueError, match="unknown difficulty"):
        make_tasks("general", "train", 1, 0, "low", "hard")


def test_cli_errors_are_one_clear_line(base_run, tmp_path, capsys):
    assert main(["rl", "--run", str(base_run), "--domain", "poetry"]) == 2
    assert "unknown domain 'poetry'" in capsys.readouterr().err
    assert main(["rl", "--run", str(base_run), "--group", "1", "--out", str(tmp_path / "o")]) == 2
    assert "--group must be >= 2" in capsys.readouterr().err
    assert main(["rl", "--run", str(base_run), "--clip", "1.5", "--out", str(tmp_path / "o")]) == 2
    assert main(["rl", "--run", str(base_run), "--difficulty", "hard", "--out", str(tmp_path / "o")]) == 2
    assert "unknown difficulty 'hard'" in capsys.readouterr().err
    assert main(["rl", "--run", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["rl", "--resume", str(base_run), "--run", str(base_run)]) == 2
    assert "drop --run" in capsys.readouterr().err
    assert main(["rl", "--resume", str(base_run)]) == 2
    assert "rl.json is missing" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_score_rollouts_judges_each_distinct_completion_once_and_keeps_the_order(monkeypatch):
    import threading

    from kimik3.posttrain.evaluate import Rollout, score_rollouts

    judged, lock = [], threading.Lock()

    def score(self, completion, reasoning_tokens=None):
        with lock:
            judged.append((self.prompt[-1]["content"], completion))
        return float(completion.endswith("!")) + 0.5 * (reasoning_tokens or 0)

    monkeypatch.setattr(Task, "score", score)
    tasks = make_tasks("general", "train", 3, 0, "low", "easy")
    rollouts = []
    for k in range(12):
        rollout = Rollout(tasks[k % 3], turns=["yes!" if k % 4 == 0 else "no"])
        rollout.reasoning_tokens = k % 2            # the same text with another reasoning length is judged anew
        rollouts.append(rollout)
    want = [r.score() for r in rollouts]
    judged.clear()
    assert score_rollouts(rollouts) == want == score_rollouts(rollouts, workers=1)
    distinct = {(id(r.task), r.completion, r.reasoning_tokens) for r in rollouts}
    assert len(judged) == 2 * len(distinct) < 2 * len(rollouts)


def test_a_groups_copies_of_a_prompt_restore_it_from_the_prefix_cache(base_run, policy_parts):
    """The first of a group's identical prompts is computed; the others wait for its first token and restore the
    prompt from the prefix cache: the same sampled tokens as an engine with prefix caching off."""
    from kimik3.posttrain.evaluate import generate_completions
    from kimik3.serve.engine import LLMEngine
    from kimik3.serve.memory import EngineConfig

    tokenizer, encoder = policy_parts
    tasks = [task for task in make_tasks("general", "train", 2, 0, "low") for _ in range(4)]
    results, hits = [], []
    for checkpoints in (0, 64):
        engine = LLMEngine(K3ForCausalLM.from_pretrained(base_run, dtype=torch.float32), tokenizer,
                           EngineConfig(max_running=8, checkpoints=checkpoints))
        try:
            rollouts = generate_completions(engine, encoder, tasks, temperature=1.0, seed=3, max_tokens=12)
            hits.append(engine.stats().prefix_hits)
        finally:
            engine.close()
        results.append([r.token_ids for r in rollouts])
    assert results[0] == results[1]
    assert hits[0] == 0 and hits[1] >= 6        # the three copies of each of the two prompts


def test_micro_batches_group_rows_of_like_lengths_and_keep_the_gradient(base_run):
    """An update's minibatch is cut into micro-batches of like lengths (each padded only to its own longest row,
    within a padded-token budget); the accumulated gradient does not depend on the cut."""
    from types import SimpleNamespace

    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.posttrain.policy_loss import make_batch
    from kimik3.posttrain.rl import RLRun

    gen = torch.Generator().manual_seed(0)
    lengths = [40, 3, 25, 4, 38, 5]                       # long and short completions interleaved
    prompts = [torch.randint(1, 600, (6,), generator=gen).tolist() for _ in lengths]
    completions = [torch.randint(1, 600, (n,), generator=gen).tolist() for n in lengths]
    logprobs = [[-1.0] * n for n in lengths]
    batch = make_batch(prompts, completions, logprobs, [1.0, -0.5, 0.3, -1.0, 0.7, 0.2])
    policy = K3ForCausalLM.from_pretrained(base_run, dtype=torch.float32)
    widths = []
    forward = policy.forward

    def recording(input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    def grads(micro_batch):
        policy.zero_grad(set_to_none=True)
        trainer = SimpleNamespace(args=SimpleNamespace(grad_clip=1e9), device=torch.device("cpu"), balancer=None,
                                  _autocast=lambda: torch.autocast("cpu", enabled=False))
        spec = SimpleNamespace(micro_batch=micro_batch, temperature=1.0, clip=0.2, kl_coef=0.0, stale_coef=0.1,
                               stale_ratio_cap=3.0)
        run = SimpleNamespace(trainer=trainer, spec=spec, policy=policy, reference=None)
        _, parts, finite = RLRun._minibatch(run, batch, np.arange(len(lengths)))
        assert finite and parts["tokens"] == sum(lengths)
        return [p.grad.clone() for p in policy.parameters() if p.grad is not None]

    policy.forward = recording
    whole = grads(len(lengths))
    # rows end at 6 + length - 1 = 45, 8, 30, 9, 43, 10 (mean 24.2); six rows' budget 145 padded tokens: the four
    # shortest (4 x 30 = 120), then the two longest (2 x 45)
    assert widths == [30, 45]
    widths.clear()
    cut = grads(2)
    # two rows a micro-batch at most, and at most 2 x 24.2 = 48 padded tokens: only the two shortest pair up
    assert widths == [9, 10, 30, 43, 45]
    for a, b in zip(whole, cut, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_the_proximal_log_probabilities_are_the_policys_before_the_update(base_run):
    """A batch with stale tokens gets ``prox``: the policy's log-probability of each completion token, computed in
    the update's micro-batches (rows of several lengths) before its first step, equal to one plain forward's."""
    from types import SimpleNamespace

    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.posttrain.policy_loss import make_batch, token_logprobs
    from kimik3.posttrain.rl import RLRun

    gen = torch.Generator().manual_seed(1)
    lengths = [30, 2, 17, 5]
    prompts = [torch.randint(1, 600, (5,), generator=gen).tolist() for _ in lengths]
    completions = [torch.randint(1, 600, (n,), generator=gen).tolist() for n in lengths]
    batch = make_batch(prompts, completions, [[-1.0] * n for n in lengths], [1.0, -1.0, 0.5, -0.5],
                       staleness=[[1] * n for n in lengths])
    policy = K3ForCausalLM.from_pretrained(base_run, dtype=torch.float32).train()
    trainer = SimpleNamespace(device=torch.device("cpu"), _autocast=lambda: torch.autocast("cpu", enabled=False))
    run = SimpleNamespace(trainer=trainer, spec=SimpleNamespace(micro_batch=2, temperature=0.7), policy=policy)
    prox = RLRun._proximal(run, batch)
    with torch.no_grad():
        expected = token_logprobs(policy, batch.input_ids, batch.targets, 0.7)
    torch.testing.assert_close(prox[batch.mask], expected[batch.mask], rtol=1e-4, atol=1e-5)
