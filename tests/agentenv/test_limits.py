"""Bad input is contained and reported: fork bombs, full disks, memory hogs, endless loops, binary floods."""

import time


def test_fork_bomb_is_contained(make_sandbox):
    sandbox = make_sandbox()
    result = sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 1", timeout=3)
    assert result.pids_limited
    assert len(sandbox.cgroup.pids()) <= sandbox.limits.pids
    sandbox.exec(["true"], timeout=5)       # may fail while the bomb's leftovers hold every pid
    sandbox.restore(sandbox.checkpoint())   # the way back: a fresh pid 1 over the same files
    assert sandbox.exec("echo ok").stdout == "ok\n"


def test_full_disk_is_reported_and_the_host_disk_untouched(sandbox):
    result = sandbox.exec("head -c 100000000 /dev/zero > /work/fill; echo $?")
    assert "No space left on device" in result.stderr and result.stdout.strip() != "0"
    assert sandbox.exec("rm /work/fill && echo x > /work/y && cat /work/y").stdout == "x\n"


def test_memory_past_the_limit_is_oom_killed_and_reported(sandbox):
    result = sandbox.exec(["python3", "-c", "x = bytearray(600 << 20); x[::4096] = b'1' * len(x[::4096])"])
    assert result.exit_code == -9 or result.exit_code == 137
    assert result.oom_killed
    assert sandbox.exec("echo fine").stdout == "fine\n"


def test_endless_program_is_stopped_at_its_timeout(sandbox):
    start = time.monotonic()
    result = sandbox.exec("while :; do :; done", timeout=0.5)
    assert result.timed_out and time.monotonic() - start < 3


def test_binary_garbage_flood_is_capped(sandbox):
    result = sandbox.exec("head -c 5000000 /dev/urandom", max_output=100_000)
    assert result.truncated and len(result.stdout_bytes) == 100_000 and result.exit_code == 0
    assert isinstance(result.stdout, str)
    endless = sandbox.exec("cat /dev/urandom", timeout=1, max_output=10_000)
    assert endless.timed_out and len(endless.stdout_bytes) == 10_000
    assert sandbox.exec("echo clean").stdout == "clean\n"
