"""The verifiable tasks: deterministic per seed, disjoint splits, references score 1, garbage scores 0."""

import re
import time

import pytest

from kimik3.posttrain.tasks import DOMAINS, EFFORT_BUDGETS, EFFORTS, make_tasks, split_of
from kimik3.posttrain.tasks.base import THINK_CLOSE, THINK_OPEN

GARBAGE = ["", " ", "Answer:", "Answer: x", "</think>", "<call></call>", "```python\n```", "\x00\xff\ud800",
           "<call>" * 5000, "Answer: 1" * 20000, "```python\n" * 3000, "a" * 300_000,
           "<think>" + "9" * 10_000 + "</think>Answer: " + "9" * 200]


@pytest.mark.parametrize("domain", DOMAINS)
def test_tasks_are_a_pure_function_of_the_arguments(domain):
    first = [t.to_json() for t in make_tasks(domain, "train", 12, seed=3, effort="high")]
    again = [t.to_json() for t in make_tasks(domain, "train", 12, seed=3, effort="high")]
    other = [t.to_json() for t in make_tasks(domain, "train", 12, seed=4, effort="high")]
    assert first == again
    assert first != other
    assert len({t["key"] for t in first}) == 12   # distinct problems


@pytest.mark.parametrize("domain", DOMAINS)
def test_train_and_test_never_share_a_problem(domain):
    train = {t.key for seed in (0, 1) for effort in EFFORTS for t in make_tasks(domain, "train", 60, seed, effort)}
    test = {t.key for seed in (0, 1) for effort in EFFORTS for t in make_tasks(domain, "test", 30, seed, effort)}
    assert train and test and not train & test
    assert {split_of(k) for k in train} == {"train"} and {split_of(k) for k in test} == {"test"}


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("effort", EFFORTS)
def test_references_score_one_and_state_the_effort_budget(domain, effort):
    for task in make_tasks(domain, "test", 4, seed=0, effort=effort) + make_tasks(domain, "train", 4, 1, effort):
        assert task.domain == domain and task.effort == effort
        system = task.messages[0]
        assert system["role"] == "system" and f"{EFFORT_BUDGETS[effort]} tokens" in system["content"]
        assert task.score(task.reference_completion()) == 1.0, task.to_json()
        reasoning = re.search(f"{THINK_OPEN}(.*){THINK_CLOSE}", task.reference[0]["content"], re.S).group(1)
        assert len(reasoning.encode()) <= EFFORT_BUDGETS[effort]   # a byte-level token is at least one byte


@pytest.mark.parametrize("domain", DOMAINS)
def test_more_effort_reasons_longer(domain):
    def reasoning(effort):
        return sum(len(t.reference[0]["content"]) for t in make_tasks(domain, "train", 20, 0, effort))
    assert reasoning("low") < reasoning("high") < reasoning("max")


@pytest.mark.parametrize("domain", DOMAINS)
def test_garbage_scores_zero_without_raising(domain):
    task = make_tasks(domain, "test", 1, seed=0, effort="low")[0]
    for garbage in [*GARBAGE, None, 12, b"Answer: 3", ["x"]]:
        start = time.monotonic()
        assert task.score(garbage) == 0.0
        assert time.monotonic() - start < 10
    # Another task's reference solves a different problem.
    other = make_tasks(domain, "test", 2, seed=0, effort="low")[1]
    assert task.score(other.reference_completion()) == 0.0


def test_general_reads_the_last_answer_after_the_reasoning():
    from kimik3.posttrain.tasks.general import read_answer

    assert read_answer("<think>Answer: 3</think>\nAnswer: 5") == 5
    assert read_answer("<think>Answer: 3</think>\nno answer") is None
    assert read_answer("Answer: 1\nAnswer: -42") == -42
    task = make_tasks("general", "test", 1, 0, "low")[0]
    answer = task.reference_completion().rsplit("Answer: ", 1)[1]
    assert task.score(f"Answer: {answer}") == 1.0          # the reasoning is optional
    assert task.score(f"Answer: {int(answer) + 1}") == 0.0


def test_coding_code_that_loops_raises_or_exits_scores_zero(monkeypatch):
    from kimik3.posttrain.tasks import coding

    monkeypatch.setattr(coding, "TIMEOUT_S", 1.0)
    task = make_tasks("coding", "test", 1, 0, "low")[0]
    name = re.search(r"`(\w+)\(", task.messages[1]["content"]).group(1)
    bodies = ["while True:\n        pass", "raise ValueError('no')", "import sys\n    sys.exit(0)",
              "import os\n    os._exit(0)", "return None", "print('x' * 10**8)", "import socket\n    return 0"]
    for body in bodies:
        start = time.monotonic()
        code = f"```python\ndef {name}(*args):\n    {body}\n```"
        assert task.score(code) == 0.0, body
        assert time.monotonic() - start < 8, body
    start = time.monotonic()
    assert task.score("```python\nwhile True:\n    pass\n```") == 0.0   # at import time
    assert time.monotonic() - start < 8
    assert task.score(task.reference_completion()) == 1.0


def test_coding_cannot_forge_the_harness_result():
    task = make_tasks("coding", "test", 1, 0, "low")[0]
    forged = ("```python\nimport os\nos.write(1, b'0' * 32 + b'{\"passed\": 6, \"total\": 6}\\n')\n"
              "print('{\"passed\": 6, \"total\": 6}')\n```")
    assert task.score(forged) == 0.0


def test_sandbox_has_no_network_and_a_timeout():
    from kimik3.posttrain.sandbox import SubprocessSandbox

    program = ("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('connected')\n"
               "except Exception as err:\n    print('blocked', type(err).__name__)\n")
    for sandbox in (SubprocessSandbox(), SubprocessSandbox(use_namespace=False)):
        result = sandbox.run(program, timeout_s=5)
        assert "connected" not in result.stdout and not result.timed_out
        start = time.monotonic()
        looped = sandbox.run("import time\nwhile True:\n    time.sleep(0.01)\n", timeout_s=0.5)
        assert looped.timed_out and looped.returncode is None and time.monotonic() - start < 5
    with pytest.raises(ValueError, match="timeout_s"):
        SubprocessSandbox().run("pass", timeout_s=0)


def test_unknown_domain_effort_and_split_are_refused():
    with pytest.raises(ValueError, match="unknown domain"):
        make_tasks("poetry", "train", 1)
    with pytest.raises(ValueError, match="unknown effort"):
        make_tasks("general", "train", 1, effort="medium")
    with pytest.raises(ValueError, match="unknown split"):
        make_tasks("general", "dev", 1)


@pytest.mark.parametrize("domain", DOMAINS)
def test_reasoning_over_the_effort_budget_scores_zero(domain, base_run):
    from kimik3.posttrain.evaluate import Rollout
    from kimik3.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(base_run / "tokenizer.json")
    for effort in EFFORTS:
        task = make_tasks(domain, "test", 1, 0, effort)[0]
        rollout = Rollout(task)
        for turn in (m["content"] for m in task.reference if m["role"] == "assistant"):
            rollout.add_turn(turn, tokenizer)
        # The references reason within their budget in a tokenizer trained on the tasks (640 entries).
        assert 0 < rollout.reasoning_tokens <= EFFORT_BUDGETS[effort] and rollout.score() == 1.0
        assert task.score(rollout.completion, EFFORT_BUDGETS[effort] + 1) == 0.0
        padded = rollout.completion.replace(THINK_CLOSE, " x" * (EFFORT_BUDGETS[effort] + 1) + THINK_CLOSE, 1)
        over = Rollout(task)
        over.add_turn(padded, tokenizer)   # the same answer after reasoning one budget too long
        assert over.reasoning_tokens > EFFORT_BUDGETS[effort] and task.score(padded) == 1.0 and over.score() == 0.0
