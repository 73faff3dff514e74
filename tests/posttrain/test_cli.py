"""`kimik3 sft` and `kimik3 eval-tasks` end to end on a small run."""

import json

from kimik3.cli import main


def test_sft_then_eval_tasks(base_run, tmp_path, capsys):
    out = tmp_path / "tuned"
    assert main(["sft", "--run", str(base_run), "--out", str(out), "--steps", "3", "--seq-len", "128",
                 "--batch-size", "2", "--tasks-per-cell", "2", "--no-progress"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "sft.json").is_file()
    assert main(["sft", "--resume", str(out), "--steps", "4", "--seq-len", "128", "--batch-size", "2",
                 "--no-progress"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    capsys.readouterr()
    completions = tmp_path / "completions.jsonl"
    assert main(["eval-tasks", "--run", str(out), "--domain", "agents", "--effort", "all", "--n", "2",
                 "--max-tokens", "6", "--no-progress", "--out", str(completions)]) == 0
    printed = capsys.readouterr().out
    for effort in ("low", "high", "max"):
        assert f"agents/{effort}: " in printed and "95% CI [" in printed
    records = [json.loads(line) for line in completions.read_text().splitlines()]
    assert len(records) == 6 and all(0.0 <= r["score"] <= 1.0 and r["turns"] for r in records)


def test_bad_arguments_are_one_clear_line(base_run, tmp_path, capsys):
    assert main(["eval-tasks", "--run", str(base_run), "--domain", "poetry"]) == 2
    assert "unknown domain 'poetry'" in capsys.readouterr().err
    assert main(["eval-tasks", "--run", str(base_run), "--n", "0"]) == 2
    assert main(["eval-tasks", "--run", str(base_run), "--samples", "4"]) == 2      # greedy: one sample only
    assert "--samples" in capsys.readouterr().err
    assert main(["sft", "--run", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["sft", "--resume", str(base_run), "--run", str(base_run)]) == 2
    assert "drop --run" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    assert main(["sft", "--run", str(base_run), "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_eval_tasks_with_several_samples_scores_each_task_by_their_mean(base_run, tmp_path, monkeypatch, capsys):
    from kimik3.posttrain.evaluate import evaluate
    from kimik3.posttrain.tasks import Task

    # Completions of even length score 1: at temperature 1 a task's samples disagree, so its mean is fractional.
    monkeypatch.setattr(Task, "score", lambda self, completion, reasoning_tokens=None: float(len(completion) % 2 == 0))
    result = evaluate(base_run, "general", "low", n=3, temperature=1.0, max_tokens=5, samples=4)
    assert len(result.scores) == 3 and len(result.rollouts) == len(result.rollout_scores) == 12
    assert result.scores == [sum(result.rollout_scores[4 * i:4 * i + 4]) / 4 for i in range(3)]
    assert [r.task for r in result.rollouts[:4]] == [result.rollouts[0].task] * 4
    assert "3 test tasks, 4 samples each" in result.describe()
    completions = tmp_path / "c.jsonl"
    assert main(["eval-tasks", "--run", str(base_run), "--domain", "general", "--effort", "low", "--n", "2",
                 "--temperature", "1", "--samples", "3", "--max-tokens", "4", "--no-progress",
                 "--out", str(completions)]) == 0
    assert "2 test tasks, 3 samples each" in capsys.readouterr().out
    assert len(completions.read_text().splitlines()) == 6
