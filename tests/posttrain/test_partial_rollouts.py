"""Partial rollouts (`kimik3 rl --partial-lambda`): the pause rule, resuming, staleness, the stale-token correction,
finished trajectories trained once their group gives them a baseline, and λ = 1 unchanged."""

import dataclasses
import hashlib
import json
import math

import pytest
import torch

from kimik3.cli import main
from kimik3.posttrain.partial import FinishedGroups, Trajectory, finish_target, partial_rollouts, trajectory_rows
from kimik3.posttrain.policy_loss import clipped_policy_loss, group_advantages, make_batch
from kimik3.posttrain.rl import RECIPE, RLSpec
from kimik3.posttrain.tasks import Task, make_tasks
from kimik3.serve.chat import ChatEncoder, load_chat_template
from kimik3.serve.types import TokenEvent
from kimik3.tokenizer import load_tokenizer


class FakeEngine:
    """Submit/abort like ``LLMEngine``, deterministic: ``plan(trajectory index, call)`` says how many tokens a
    request streams at once and whether it then finishes ("length") or hangs until aborted."""

    def __init__(self, tokenizer, plan):
        self.tokenizer, self.plan = tokenizer, plan
        self.submitted, self.open, self.calls = [], {}, 0

    def submit(self, request, sink):
        i = int(request.request_id.split("-")[1])
        self.submitted.append((i, list(request.prompt_ids), request.params.max_tokens))
        count, finishes = self.plan(i, self.calls)
        count = min(count, request.params.max_tokens)
        for k in range(count):
            last = finishes and k == count - 1
            sink(TokenEvent(request.request_id, 5 + k, "x", logprob=-0.5 - 0.01 * k, finished=last,
                            finish_reason="length" if last else None))
        if not finishes:
            self.open[request.request_id] = sink

    def abort(self, request_id):
        sink = self.open.pop(request_id, None)
        if sink is not None:
            sink(TokenEvent(request_id, None, "", finished=True, finish_reason="abort"))


@pytest.fixture(scope="module")
def encoder(base_run):
    tokenizer = load_tokenizer(base_run / "tokenizer.json", vocab_size=640)
    encoder = ChatEncoder(tokenizer, load_chat_template(None, base_run))
    encoder.tokenizer = tokenizer        # what the fake engine decodes with
    return encoder


def _trajectories(n, budget=8):
    tasks = make_tasks("general", "train", n, 0, "low")
    return [Trajectory(task, (0, i), 0, budget) for i, task in enumerate(tasks)]


def test_finish_target_is_ceil_lambda_n_and_bad_lambda_is_refused():
    assert [finish_target(0.7, n) for n in (1, 10, 32, 3)] == [1, 7, 23, 3]
    assert finish_target(1.0, 5) == 5 and finish_target(0.01, 5) == 1
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="--partial-lambda"):
            finish_target(bad, 4)
    with pytest.raises(ValueError, match="--partial-lambda"):
        RLSpec("run", "general", "low", partial_lambda=0.0).validate()
    with pytest.raises(ValueError, match="--stale-ratio-cap"):
        RLSpec("run", "general", "low", partial_lambda=0.5, stale_ratio_cap=1.1).validate()


def test_pause_rule_resume_first_and_staleness(encoder):
    # 10 trajectories, λ = 0.7: the 7 short ones finish (8 tokens), the 3 long ones stream 3 tokens, then hang.
    trajectories = _trajectories(10)
    engine = FakeEngine(encoder.tokenizer, lambda i, call: (8, True) if i < 7 else (3, False))
    stats = partial_rollouts(engine, encoder, trajectories, 0.7, version=0, seed=1)
    assert (stats.target, stats.finished, stats.paused, stats.completion_tokens) == (7, 7, 3, 7 * 8 + 3 * 3)
    paused = [t for t in trajectories if not t.finished]
    assert [t.rollout.turns for t in paused] == [[], [], []]          # mid-turn: nothing finished
    for t in paused:
        assert t.partial_ids == [5, 6, 7] and t.partial_versions == [0, 0, 0] and t.pauses == 1
        assert t.partial_logprobs == pytest.approx([-0.5, -0.51, -0.52])
    # Next iteration: the paused ones first, then 2 new; the resumed continue from their tokens with the rest of
    # their budget, under version 1.
    new = _trajectories(2)
    engine = FakeEngine(encoder.tokenizer, lambda i, call: (8, True))
    stats = partial_rollouts(engine, encoder, paused + new, 1.0, version=1, seed=2)
    assert stats.resumed == 3 and stats.finished == 5
    order = [i for i, _, _ in engine.submitted]
    assert order == [0, 1, 2, 3, 4]
    for (i, prompt, budget), t in zip(engine.submitted[:3], paused):
        assert prompt == t.rollout.prompt_ids[0] + [5, 6, 7] and budget == 8 - 3
    t = paused[0]
    assert t.rollout.token_ids == [[5, 6, 7, 5, 6, 7, 8, 9]] and t.versions == [[0, 0, 0, 1, 1, 1, 1, 1]]
    assert len(t.rollout.logprobs[0]) == 8 and t.rollout.tokens == 8
    # The rows: prompt as first seen, all 8 tokens, staleness against the updated version 1.
    prompts, completions, logprobs, staleness, advs = trajectory_rows([t, new[0]], [1.0, -1.0], current_version=1)
    assert staleness == [[1, 1, 1, 0, 0, 0, 0, 0], [0] * 8] and advs == [1.0, -1.0]
    assert completions[0] == t.rollout.token_ids[0] and prompts[0] == t.rollout.prompt_ids[0]
    with pytest.raises(ValueError, match="only finished"):
        trajectory_rows(_trajectories(1), [1.0], 0)
    with pytest.raises(ValueError, match="cannot be rolled out again"):
        partial_rollouts(engine, encoder, [t], 0.5, version=2, seed=0)


def test_tool_use_trajectory_pauses_between_turns_and_resumes_its_next_turn(encoder):
    task = make_tasks("agents", "train", 1, 0, "low")[0]
    calls = "<call>get a</call>"
    ids = encoder.tokenizer.encode(calls).ids
    shorts = _trajectories(1)
    agent = Trajectory(task, (0, 1), 0, 64)

    class Engine(FakeEngine):
        def submit(self, request, sink):   # the agent answers with a call; the other one finishes
            self.submitted.append(request.request_id)
            if request.request_id.startswith("traj-0"):
                return super().submit(request, sink)
            for k, token in enumerate(ids):
                last = k == len(ids) - 1
                sink(TokenEvent(request.request_id, token, "", logprob=-1.0, finished=last,
                                finish_reason="stop" if last else None))

    engine = Engine(encoder.tokenizer, lambda i, call: (4, True))
    # λ = 0.5 of 2: the short one finishing stops generation; the agent, whose turn ended with a call, pauses
    # between turns (its next turn is not submitted).
    stats = partial_rollouts(engine, encoder, shorts + [agent], 0.5, version=0, seed=0)
    assert stats.finished == 1 and not agent.finished
    assert len(agent.rollout.turns) == 1 and agent.partial_ids == [] and agent.turn_prompt is None
    assert agent.conversation[-1]["role"] == "user"                   # the tool's result is waiting
    before = len(engine.submitted)
    partial_rollouts(engine, encoder, [agent], 1.0, version=1, seed=0)
    assert len(engine.submitted) > before and agent.rollout.prompt_ids[1][:len(agent.rollout.prompt_ids[0])] \
        == agent.rollout.prompt_ids[0]


def _finished_members(group, members):
    task = make_tasks("general", "train", 1, 0, "low")[0]
    out = [Trajectory(task, group, m, 8) for m in members]
    for t in out:
        t.finished = True
    return out


def test_finished_members_train_once_their_group_gives_a_baseline():
    """Normalised over the members finished so far (two or more, rewards not all alike); a lone or uniform early
    finisher waits; the last member is compared with all G; a group finished at once is scored as group_advantages
    scores it; each member is trained once."""
    book = FinishedGroups(4)
    a, b, c, d = _finished_members((0, 0), range(4))
    train, rewards, advs, completed = book.add([a, b], [1.0, 0.0])
    assert train == [a, b] and rewards == [1.0, 0.0] and advs == pytest.approx([1.0, -1.0], rel=1e-5)
    assert completed == 0 and book.waiting == 1
    train, _, advs, _ = book.add([c], [1.0])            # normalised over {1, 0, 1}
    assert train == [c] and advs == pytest.approx([(1 - 2 / 3) / math.sqrt(2 / 9)], rel=1e-5)
    train, _, advs, completed = book.add([d], [0.0])    # over all four: mean 0.5, std 0.5
    assert train == [d] and advs == pytest.approx([-1.0], rel=1e-5) and completed == 1 and book.waiting == 0

    e, f, g, h = _finished_members((1, 3), range(4))
    assert book.add([f], [1.0])[0] == [] and book.add([h], [1.0])[0] == []   # one, then two alike: no baseline
    train, _, advs, _ = book.add([e], [0.0])
    assert [t.member for t in train] == [0, 1, 3] and advs[0] < 0 < advs[1] == advs[2]
    train, _, advs, completed = book.add([g], [1.0])
    assert train == [g] and completed == 1

    rewards = [0.2, 0.9, 0.4, 0.4]
    at_once = _finished_members((2, 0), [2, 0, 3, 1])
    train, got, advs, completed = book.add(at_once, [rewards[t.member] for t in at_once])
    assert [t.member for t in train] == [0, 1, 2, 3] and got == rewards and completed == 1
    assert advs == group_advantages(rewards, 4)
    alike = _finished_members((3, 0), range(4))
    train, _, advs, completed = book.add(alike, [1.0] * 4)    # complete, zero variance: advantage 0 (no rows)
    assert len(train) == 4 and advs == [0.0] * 4 and completed == 1 and book.waiting == 0

    with pytest.raises(ValueError, match="finished twice"):
        book.add(_finished_members((4, 0), [1, 1]), [0.0, 1.0])
    assert book.add(_finished_members((7, 0), [0]), [1.0])[0] == [] and book.waiting == 1
    with pytest.raises(ValueError, match="finished twice"):
        book.add(_finished_members((4, 1), [0]) + _finished_members((7, 0), [0]), [0.0, 1.0])
    assert book.waiting == 1                                  # refused whole: nothing of it recorded
    with pytest.raises(ValueError, match="a group has 4 members"):
        book.add(_finished_members((4, 0), [4]), [0.0])
    with pytest.raises(ValueError, match="2 trajectories with 1 rewards"):
        book.add(_finished_members((5, 0), [0, 1]), [0.0])
    unfinished = _finished_members((6, 0), [0])
    unfinished[0].finished = False
    with pytest.raises(ValueError, match="only finished"):
        book.add(unfinished, [0.0])


def test_stale_correction_matches_a_hand_computation():
    """Stale tokens: the clip around prox (the policy before the update), the weight exp(prox - old) truncated at C,
    the staleness-weighted regulariser to old; the fresh token keeps the plain clipped ratio to old."""
    clip, cap, coef = 0.2, 3.0, 0.1
    new = torch.tensor([[0.0, math.log(1.5), math.log(4.0), math.log(0.5), 0.7]], requires_grad=True)
    old = torch.zeros(1, 5)
    prox = torch.tensor([[0.0, math.log(1.4), math.log(4.0 / 0.7), math.log(0.5), 0.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    stale = torch.tensor([[0.0, 2.0, 1.0, 3.0, 5.0]])
    weights = [1.0, 1.4, 3.0, 0.5]          # exp(prox - old), the third truncated at C
    trust = [1.0, 1.5 / 1.4, 0.7, 1.0]      # exp(new - prox) (the fresh token's: exp(new - old))
    with pytest.raises(ValueError, match="proximal"):
        clipped_policy_loss(new, old, torch.tensor([1.0]), mask, clip, staleness=stale, stale_coef=coef,
                            ratio_cap=cap)
    for a in (1.0, -1.0):
        parts = clipped_policy_loss(new, old, torch.tensor([a]), mask, clip, staleness=stale, stale_coef=coef,
                                    ratio_cap=cap, prox=prox)
        held = [min(r * a, min(max(r, 1 - clip), 1 + clip) * a) for r in trust]   # 0.7 is held at 0.8 for A < 0
        reg = [0.0] + [coef * s * 0.5 * math.log(r) ** 2 for s, r in zip([2, 1, 3], [1.5, 4.0, 0.5])]
        expected = (-sum(w * h for w, h in zip(weights, held)) + sum(reg)) / 4
        assert float(parts.loss.detach()) == pytest.approx(expected, rel=1e-6)
        assert parts.stale == 3 and parts.truncated == 1.0 and parts.stale_reg == pytest.approx(sum(reg), rel=1e-6)
        assert parts.clipped == (1.0 if a < 0 else 0.0)
    # Gradient (A = -1): -w * A * r where the clip does not hold, plus the regulariser's coef * s * log(new / old);
    # the held token gets the regulariser's alone.
    parts.loss.backward()
    grad = new.grad[0].tolist()
    assert grad[0] == pytest.approx(1.0 / 4, rel=1e-5) and grad[4] == 0.0
    assert grad[1] == pytest.approx((1.5 + coef * 2 * math.log(1.5)) / 4, rel=1e-5)
    assert grad[2] == pytest.approx(coef * 1 * math.log(4.0) / 4, rel=1e-5)
    assert grad[3] == pytest.approx((0.5 + coef * 3 * math.log(0.5)) / 4, rel=1e-5)


def test_lambda_one_leaves_the_loss_and_the_fingerprint_unchanged():
    torch.manual_seed(0)
    new, old = torch.randn(3, 6), torch.randn(3, 6)
    mask = torch.rand(3, 6) > 0.3
    adv = torch.tensor([1.0, -0.5, 2.0])
    plain = clipped_policy_loss(new, old, adv, mask, 0.2)
    fresh = clipped_policy_loss(new, old, adv, mask, 0.2, staleness=torch.zeros(3, 6), stale_coef=1.0, ratio_cap=1.5)
    assert torch.equal(plain.loss, fresh.loss) and fresh.stale == 0
    batch = make_batch([[1, 2], [3]], [[4, 5], [6]], [[-1.0, -2.0], [-3.0]], [1.0, -1.0], staleness=[[0, 1], [2]])
    assert batch.staleness[batch.mask].tolist() == [0.0, 1.0, 2.0]
    assert make_batch([[1]], [[2]], [[-1.0]], [1.0]).staleness is None
    spec = RLSpec("run", "general", "low")
    # The fingerprint of an rl.json written before the partial settings, epochs and prompt pools existed (a --resume
    # must still match).
    fields = {k: v for k, v in dataclasses.asdict(spec).items()
              if k not in ("partial_lambda", "stale_coef", "stale_ratio_cap", "stale_limit", "epochs", "prompt_pool")}
    assert spec.fingerprint == hashlib.sha256(json.dumps([RECIPE, fields], sort_keys=True).encode()).hexdigest()
    assert RLSpec("run", "general", "low", stale_coef=5.0).fingerprint == spec.fingerprint    # λ = 1: ignored
    assert RLSpec("run", "general", "low", partial_lambda=0.7).fingerprint != spec.fingerprint


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def some_reward(monkeypatch):
    monkeypatch.setattr(Task, "score",
                        lambda self, completion, reasoning_tokens=None: float(len(completion) % 2 == 0))


def test_rl_with_partial_rollouts_trains_finished_trajectories(base_run, tmp_path, some_reward, capsys):
    out = tmp_path / "rl"
    assert main(["rl", "--run", str(base_run), "--out", str(out), "--iterations", "3", "--group", "2", "--prompts",
                 "3", "--max-tokens", "12", "--partial-lambda", "0.5", "--lr", "1e-2", "--checkpoint-every", "100",
                 "--no-progress"]) == 0
    assert " trained, stale tokens" in capsys.readouterr().out
    records = _records(out)
    assert json.loads((out / "rl.json").read_text())["rl"]["partial_lambda"] == 0.5
    assert records[0]["resumed"] == 0 and records[0]["trajectories"] == 6
    for r in records:
        assert r["finished"] >= r["finish_target"] == math.ceil(0.5 * r["trajectories"])
        assert r["trajectories"] == 6 + r["resumed"] and 0 <= r["stale_token_fraction"] <= 1
        assert r["finished"] + r["paused"] == r["trajectories"]
    # Everything paused in one iteration is resumed in the next, first.
    for before, after in zip(records, records[1:]):
        assert after["resumed"] == before["paused"]
    assert records[0]["stale_token_fraction"] == 0.0 and records[0]["max_staleness"] == 0
    # Each finished trajectory is trained at most once, and never before it finished.
    assert 0 < sum(r["trained"] for r in records) <= sum(r["finished"] for r in records)
    assert all(r["trained"] <= sum(q["finished"] for q in records[:i + 1]) for i, r in enumerate(records))


def test_stale_limit_keeps_too_stale_tokens_out_of_the_loss(base_run, tmp_path, some_reward, monkeypatch):
    """--stale-limit 0: every stale token is context only (none reaches the loss), counted as limited, and no
    proximal pass runs (it serves only stale tokens in the loss); the same run without the limit trains on stale
    tokens, after a proximal pass. A negative limit is refused."""
    from kimik3.posttrain.policy_update import PolicyUpdate

    proximal = PolicyUpdate._proximal
    passes = []
    monkeypatch.setattr(PolicyUpdate, "_proximal", lambda self, batch: passes.append(1) or proximal(self, batch))
    runs, proximal_passes = {}, {}
    for name, extra in (("limited", ["--stale-limit", "0"]), ("unlimited", [])):
        passes.clear()
        out = tmp_path / name
        assert main(["rl", "--run", str(base_run), "--out", str(out), "--iterations", "4", "--group", "2",
                     "--prompts", "3", "--max-tokens", "12", "--partial-lambda", "0.5", "--lr", "1e-2",
                     "--checkpoint-every", "100", "--no-progress", *extra]) == 0
        runs[name] = _records(out)
        proximal_passes[name] = len(passes)
    assert proximal_passes["limited"] == 0 and proximal_passes["unlimited"] > 0
    assert json.loads((tmp_path / "limited" / "rl.json").read_text())["rl"]["stale_limit"] == 0
    assert all(r["stale_tokens"] == 0 for r in runs["limited"])
    assert sum(r["stale_limited"] for r in runs["limited"]) > 0
    assert sum(r["stale_tokens"] for r in runs["unlimited"]) > 0 and "stale_limited" not in runs["unlimited"][0]
    # Without partial rollouts nothing is stale: the limit changes nothing and counts nothing.
    plain = tmp_path / "plain"
    assert main(["rl", "--run", str(base_run), "--out", str(plain), "--iterations", "1", "--group", "2",
                 "--prompts", "2", "--max-tokens", "8", "--stale-limit", "0", "--checkpoint-every", "100",
                 "--no-progress"]) == 0
    assert "stale_limited" not in _records(plain)[0]
    with pytest.raises(ValueError, match="--stale-limit must be >= 0"):
        RLSpec("run", "general", "low", partial_lambda=0.5, stale_limit=-1).validate()
    assert RLSpec("run", "general", "low", partial_lambda=0.5, stale_limit=2).fingerprint != \
        RLSpec("run", "general", "low", partial_lambda=0.5).fingerprint
