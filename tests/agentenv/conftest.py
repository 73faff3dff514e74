"""Sandboxes for the AgentENV tests: skipped, naming what is missing, where the machine cannot make them."""

import pytest

from kimik3.agentenv import facilities


def require_facilities():
    missing = facilities.missing()
    if missing:
        pytest.skip("AgentENV needs: " + "; ".join(missing))


@pytest.fixture
def make_sandbox(tmp_path):
    """A factory of sandboxes (checkpoints under tmp_path); every one is closed after the test."""
    require_facilities()
    from kimik3.agentenv import Limits, Sandbox

    made = []

    def make(**kwargs):
        kwargs.setdefault("limits", Limits(cpus=1.0, memory_bytes=256 << 20, pids=64, disk_bytes=32 << 20,
                                           timeout_s=10))
        kwargs.setdefault("store", str(tmp_path / "checkpoints"))
        sandbox = Sandbox.create(**kwargs)
        made.append(sandbox)
        return sandbox

    yield make
    for sandbox in made:
        sandbox.close()
    leftover = [line for line in open("/proc/self/mountinfo") if "kimik3-agentenv" in line]
    assert not leftover, f"mounts left in the test process's namespace: {leftover}"


@pytest.fixture
def sandbox(make_sandbox):
    return make_sandbox()
