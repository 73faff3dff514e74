"""`kimik3 mopd`: the clipped log-ratio reward, routing by cell, teacher errors, a run end to end, and that
distilling moves the student toward its teacher."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from kimik3.cli import main
from kimik3.model.k3 import K3ForCausalLM
from kimik3.posttrain.mopd import MOPDRun, MOPDSpec, iteration_tasks, opd_rewards, resolve_teachers, run_mopd
from kimik3.posttrain.policy_loss import clipped_policy_loss, make_batch, token_logprobs
from kimik3.posttrain.rl import RLSpec
from kimik3.posttrain.rl import iteration_tasks as rl_iteration_tasks


def test_reward_is_the_clipped_stop_gradient_log_ratio():
    teacher = torch.tensor([[-1.0, -0.5, -9.0, 0.0, -2.0]], requires_grad=True)
    student = torch.tensor([[-2.0, -4.0, -1.0, 0.0, -1.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    r = opd_rewards(teacher, student, mask, r_max=2.0)
    # log-ratios 1, 3.5 (clipped to 2), -8 (clipped to -2), 0; the last token is off the mask
    assert r.tolist() == [[1.0, 2.0, -2.0, 0.0, 0.0]]
    assert not r.requires_grad                                   # stop-gradient: a constant of the update
    # As per-token advantages of the clipped objective at ratio 1: loss = -mean(r), d loss / d new_t = -r_t / n.
    new = student.detach().clone().requires_grad_(True)
    parts = clipped_policy_loss(new, student.detach(), r, mask.bool(), clip=0.2)
    assert float(parts.loss.detach()) == pytest.approx(-(1 + 2 - 2 + 0) / 4)
    parts.loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-0.25, -0.5, 0.5, 0.0, 0.0])
    # Per-token advantages survive row selection (the micro-batches of the update).
    batch = make_batch([[1, 2], [3]], [[4, 5], [6]], [[-1.0, -1.0], [-1.0]], [0.0, 0.0])
    batch.advantages = torch.arange(batch.old.numel(), dtype=torch.float32).view_as(batch.old)
    sub = batch.rows(torch.tensor([1]))
    assert sub.advantages.shape == sub.old.shape and sub.advantages[0, 0] == batch.advantages[1, 0]


class _Teacher(torch.nn.Module):
    """A fake teacher: logits that favour token ``favourite``; records the rows it scored."""

    def __init__(self, favourite: int, vocab: int = 8):
        super().__init__()
        self.favourite, self.vocab, self.seen = favourite, vocab, []

    def forward(self, input_ids):
        self.seen.append(input_ids.clone())
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., self.favourite] = 3.0
        return SimpleNamespace(logits=logits)


def test_each_prompt_is_scored_by_its_cells_teacher_only():
    spec = MOPDSpec("student", ["a", "b", "c"], ["general:low", "general:high", "agents:max"], prompts=4, group=2)
    tasks, cells = iteration_tasks(spec, seed=0, iteration=1)
    assert len(tasks) == 8 and cells == [1, 1, 2, 2, 0, 0, 1, 1]       # cells in turn from (1 * 4) mod 3
    for task, c in zip(tasks, cells):
        assert f"{task.domain}:{task.effort}" == spec.cells[c]
    teachers = [_Teacher(favourite=k) for k in range(3)]
    run = MOPDRun.__new__(MOPDRun)
    run.spec, run.teachers = spec, teachers
    run.trainer = SimpleNamespace(device=torch.device("cpu"), _autocast=torch.no_grad)
    batch = make_batch([[1, 2], [3], [4, 5, 6], [7]], [[0, 1], [2], [1], [0, 0, 0]],
                       [[-1.0] * 2, [-1.0], [-1.0], [-1.0] * 3], [0.0] * 4)
    row_cells = [2, 0, 2, 1]
    lp = run.teacher_logprobs(batch, row_cells)
    for k, teacher in enumerate(teachers):
        seen = torch.cat([s[:, 0] for s in teacher.seen]).tolist() if teacher.seen else []
        assert sorted(seen) == sorted(int(batch.input_ids[i, 0]) for i, c in enumerate(row_cells) if c == k)
        for i, c in enumerate(row_cells):
            if c == k:
                want = token_logprobs(teacher, batch.input_ids[i:i + 1], batch.targets[i:i + 1])[0]
                m = batch.mask[i]
                assert torch.allclose(lp[i][m], want[m])


def test_mopd_draws_the_problems_rl_on_the_mixture_draws():
    """MOPD and RL on the same cells (``--domain all --effort all``) see the same prompts in the same order, so their
    comparison is over the same problems; two efforts of one domain draw different problems."""
    rl = RLSpec("student", "all", "all", prompts=12, group=2)
    spec = MOPDSpec("student", ["t"] * 9, [f"{d}:{e}" for d, e in rl.cells], prompts=12, group=2)
    for iteration in (0, 3):
        tasks, _ = iteration_tasks(spec, seed=5, iteration=iteration)
        assert [t.messages for t in tasks] == [t.messages for t in rl_iteration_tasks(rl, 5, iteration)]
    first, _ = iteration_tasks(MOPDSpec("s", ["t", "t"], ["general:low", "general:high"], prompts=2, group=1), 0, 0)
    assert first[0].key != first[1].key


@pytest.fixture(scope="module")
def teacher_run(base_run, tmp_path_factory):
    """A teacher unlike the student but within its reach: the student's weights with the output head scaled by 8 (a
    peaked distribution, confident of its greedy continuation, which the near-uniform student gives ~5 nats of
    KL per token less than it). A teacher of another initialisation is out of reach at this scale: nearly every
    sampled token's log-ratio hits -R_max, so the reward no longer tells tokens apart (docs/posttraining.md)."""
    run = tmp_path_factory.mktemp("teachers") / "sharp"
    model = K3ForCausalLM.from_pretrained(base_run)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(run)
    shutil.copy(base_run / "tokenizer.json", run / "tokenizer.json")
    return run


def _copy(run, directory, cell=None):
    shutil.copytree(run, directory)
    if cell is not None:
        domain, effort = cell.split(":")
        RLSpec(str(run), domain, effort).write(directory)
    return directory


def test_teacher_errors(base_run, tmp_path, capsys):
    a = _copy(base_run, tmp_path / "a", "general:low")
    b = _copy(base_run, tmp_path / "b", "general:low")
    bare = _copy(base_run, tmp_path / "bare")
    assert resolve_teachers([a, bare], ["general:low", "coding:max"]) == ["general:low", "coding:max"]
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        resolve_teachers([a, tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a run with a saved model"):
        resolve_teachers([tmp_path / "empty"])
    with pytest.raises(ValueError, match="unknown .*--teacher-cells"):
        resolve_teachers([a, bare])
    with pytest.raises(ValueError, match="both for general:low"):
        resolve_teachers([a, b])
    with pytest.raises(ValueError, match="both for agents:high"):
        resolve_teachers([bare, bare], ["agents:high", "agents:high"])
    with pytest.raises(ValueError, match="rl.json.*says general:high"):
        resolve_teachers([a], ["general:high"])
    with pytest.raises(ValueError, match="2 cells for 1 teachers"):
        resolve_teachers([bare], ["general:low", "general:high"])
    with pytest.raises(ValueError, match="effort"):
        resolve_teachers([bare], ["general:extreme"])
    with pytest.raises(ValueError, match="domain:effort"):
        resolve_teachers([bare], ["general"])
    # On the command line: one clear line, exit status 2.
    capsys.readouterr()
    assert main(["mopd", "--run", str(base_run), "--teachers", str(a), str(b), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimik3 mopd: error: teachers") and err.count("\n") == 1
    assert main(["mopd", "--run", str(base_run), "--no-progress"]) == 2
    assert "--teachers" in capsys.readouterr().err


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_mopd_runs_end_to_end_resumes_and_writes_a_loadable_run(base_run, teacher_run, tmp_path, capsys):
    t1 = _copy(teacher_run, tmp_path / "t-low", "general:low")        # the cell from its rl.json
    t2 = _copy(teacher_run, tmp_path / "t-high")                      # the cell from --teacher-cells
    out = tmp_path / "student"
    common = ["--iterations", "2", "--prompts", "2", "--group", "2", "--max-tokens", "10", "--checkpoint-every", "1",
              "--no-progress"]
    assert main(["mopd", "--run", str(base_run), "--teachers", str(t1), str(t2), "--teacher-cells",
                 "general:low,general:high", "--out", str(out), "--lr", "1e-2", "--r-max", "3", *common]) == 0
    assert "iteration 1: r_opd" in capsys.readouterr().out
    records = _records(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert set(r["cells"]) == {"general:low", "general:high"}
        for cell in r["cells"].values():
            assert cell["completion_tokens"] > 0 and -3 <= cell["opd_reward"] <= 3 and "kl_to_teacher" in cell
        assert r["optimizer_steps"] > 0 and r["ratio_max_dev"] < 1e-2       # the first minibatch is on-policy
    for name in ("model.safetensors", "config.json", "tokenizer.json", "mopd.json", "mopd.png", "run.json"):
        assert (out / name).is_file(), name
    changed = K3ForCausalLM.from_pretrained(out).state_dict()
    start = K3ForCausalLM.from_pretrained(base_run).state_dict()
    assert any(not torch.equal(changed[k], start[k]) for k in start)
    assert main(["mopd", "--resume", str(out), "--iterations", "3", "--checkpoint-every", "1", "--no-progress"]) == 0
    assert [r["step"] for r in _records(out)] == [0, 1, 2] and _records(out)[:2] == records


def _greedy_logprob(student_dir, teacher, prompt, n=8):
    """The student's summed log-probability of the teacher's greedy continuation of ``prompt`` (n tokens)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(teacher(torch.tensor([ids])).logits[0, -1].argmax()))
        student = K3ForCausalLM.from_pretrained(student_dir).eval()
        x = torch.tensor([ids[:-1]])
        lp = token_logprobs(student, x, torch.tensor([ids[1:]]))[0, len(prompt) - 1:]
    return float(lp.sum())


def test_distilling_raises_the_students_logprob_of_the_teachers_greedy_continuation(base_run, teacher_run, tmp_path):
    from kimik3.posttrain.rollout import RolloutEngine
    from kimik3.posttrain.tasks import make_tasks
    from kimik3.serve.chat import ChatEncoder, load_chat_template
    from kimik3.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(base_run / "tokenizer.json", vocab_size=640)
    student = K3ForCausalLM.from_pretrained(base_run)
    engine = RolloutEngine(student, tokenizer, ChatEncoder(tokenizer, load_chat_template(None, base_run)))
    try:
        tasks = make_tasks("general", "test", 2, 0, "low")
        prompts = [r.prompt_ids[0] for r in engine.rollouts(tasks, seed=0, max_tokens=1)[0]]
    finally:
        engine.close()
    teacher = K3ForCausalLM.from_pretrained(teacher_run).eval()
    before = [_greedy_logprob(base_run, teacher, p) for p in prompts]
    records = run_mopd(base_run, teachers=[teacher_run], teacher_cells=["general:low"], iterations=8, prompts=2,
                       group=8, lr=1e-2, max_tokens=8, r_max=5.0, out=tmp_path / "student", progress=False,
                       log=lambda _: None)
    after = [_greedy_logprob(tmp_path / "student", teacher, p) for p in prompts]
    assert all(a > b + 1.0 for a, b in zip(after, before)), (before, after)
    first, last = (sum(r["kl_to_teacher"] for r in part) / 2 for part in (records[:2], records[-2:]))
    assert last < first - 1.0, [r["kl_to_teacher"] for r in records]
