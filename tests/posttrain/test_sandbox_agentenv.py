"""The coding domain's AgentENV backend: judging in a fork of the trajectory's sandbox, and the choice
of backend."""

import logging

import pytest

from kimik3.posttrain.sandbox import AgentEnvSandbox, SubprocessSandbox, _pick_backend


def _agentenv_or_skip():
    from kimik3.agentenv import facilities

    missing = facilities.missing()
    if missing:
        pytest.skip("AgentENV needs: " + "; ".join(missing))


@pytest.fixture
def judge():
    _agentenv_or_skip()
    from kimik3.agentenv import Limits

    backend = AgentEnvSandbox(limits=Limits(memory_bytes=256 << 20, pids=64, disk_bytes=32 << 20, timeout_s=10))
    yield backend
    backend.close()


def test_judging_runs_in_a_fork_and_leaves_the_trajectory_untouched(judge):
    judge.trajectory.exec("echo agent-work > /work/notes.txt")
    program = ("import os\nprint(open('/work/notes.txt').read().strip())\n"
               "open('/work/notes.txt', 'w').write('judge was here')\nos.remove('/work/notes.txt')\n"
               "open('/work/judge-only', 'w').write('x')\n")
    result = judge.run(program, timeout_s=5)
    assert (result.returncode, result.stdout, result.timed_out) == (0, "agent-work\n", False)
    assert judge.trajectory.exec("cat /work/notes.txt; ls /work").stdout == "agent-work\nnotes.txt\n"


def test_agentenv_judge_has_no_network_and_a_timeout(judge):
    blocked = judge.run("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
                        "    print('connected')\nexcept OSError:\n    print('blocked')\n")
    assert blocked.stdout == "blocked\n"
    looped = judge.run("while True:\n    pass\n", timeout_s=0.5)
    assert looped.timed_out and looped.returncode is None
    assert judge.run("import sys; sys.exit(3)").returncode == 3
    with pytest.raises(ValueError, match="timeout_s"):
        judge.run("pass", timeout_s=0)


def test_coding_task_is_judged_through_agentenv(judge):
    from kimik3.posttrain.tasks import make_tasks
    from kimik3.posttrain.tasks.coding import extract_code, run_tests

    task = make_tasks("coding", "test", 1, 0, "low")[0]
    reference = task.reference_completion()
    name = task.key.split("|")[2]
    # the reference passes all tests through AgentENV; a wrong body passes none... or few
    code = extract_code(reference)
    passed, total = run_tests(code, name, [([1], None)] * 0 or _tests_of(task), sandbox=judge)
    assert passed == total > 0
    forged = "import os\nos.write(1, b'0' * 32 + b'{\"passed\": 6, \"total\": 6}\\n')\n"
    assert run_tests(forged, name, _tests_of(task), sandbox=judge)[0] == 0


def _tests_of(task):
    """The hidden tests of a coding task, read from its verdict's closure."""
    closure = {name: cell.cell_contents for name, cell in
               zip(task.verdict.__code__.co_freevars, task.verdict.__closure__ or ())}
    return closure["tests"]


def test_backend_choice_is_logged(monkeypatch, caplog):
    from kimik3.agentenv import facilities

    monkeypatch.setattr(facilities, "probe", lambda: {"cgroups": "cgroup v1 controllers not mounted: freezer"})
    with caplog.at_level(logging.INFO, logger="kimik3.posttrain.sandbox"):
        assert isinstance(_pick_backend(), SubprocessSandbox)
    assert "weaker isolation" in caplog.text and "freezer" in caplog.text
    monkeypatch.setattr(facilities, "probe", lambda: {"cgroups": None})
    with caplog.at_level(logging.INFO, logger="kimik3.posttrain.sandbox"):
        assert isinstance(_pick_backend(), AgentEnvSandbox)
    assert "AgentEnvSandbox" in caplog.text
