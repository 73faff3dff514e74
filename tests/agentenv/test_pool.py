"""SandboxPool: paused when idle, evicted to disk past the memory budget, restored on use."""

import pytest


@pytest.fixture
def pool(tmp_path):
    from tests.agentenv.conftest import require_facilities

    require_facilities()
    from kimik3.agentenv import Limits
    from kimik3.agentenv.pool import SandboxPool

    with SandboxPool(memory_budget=24 << 20, store=str(tmp_path / "store"),
                     limits=Limits(memory_bytes=128 << 20, pids=64, disk_bytes=32 << 20, timeout_s=10)) as pool:
        yield pool


def test_pool_pauses_evicts_and_restores(pool):
    keys = [pool.create() for _ in range(3)]
    for i, key in enumerate(keys):
        with pool.use(key) as sandbox:
            sandbox.exec(f"head -c 10000000 /dev/zero > /work/blob; echo {i} > /work/id")   # 10 MB of tmpfs
        assert pool.state(key) in ("paused", "evicted")
    stats = pool.stats()
    assert stats["evicted"] >= 1 and stats["live_memory"] <= pool.memory_budget
    assert stats["active"] == 0
    for i, key in enumerate(keys):                      # every one comes back with its files
        with pool.use(key) as sandbox:
            assert sandbox.exec("cat /work/id; wc -c < /work/blob").stdout == f"{i}\n10000000\n"
    with pytest.raises(KeyError, match="no sandbox"):
        with pool.use("nope"):
            pass


def test_pool_survives_a_bad_sandbox(pool):
    bad, good = pool.create(), pool.create()
    with pool.use(bad) as sandbox:
        result = sandbox.exec("bomb() { bomb | bomb & }; bomb; cat /dev/urandom", timeout=2, max_output=1000)
        assert result.pids_limited                  # (cat may not even start once the bomb holds every pid)
        assert result.timed_out or result.exit_code != 0
    with pool.use(good) as sandbox:
        assert sandbox.exec("echo still fine").stdout == "still fine\n"
    child = pool.fork(good)
    with pool.use(child) as sandbox:
        assert sandbox.exec("echo forked").stdout == "forked\n"
    pool.close(bad)
    assert len(pool) == 2
