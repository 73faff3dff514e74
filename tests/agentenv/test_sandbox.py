"""The Sandbox API: exec (shell string, argv, stdin, exit codes, timeout), files, pause/resume, close."""

import os
import subprocess
import time

import pytest


def test_exec_shell_string_argv_and_stdin(sandbox):
    result = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    argv = sandbox.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME"])
    assert argv.exit_code == 0 and argv.stdout == "['a b', '$HOME']\n"
    piped = sandbox.exec("tr a-z A-Z", stdin="hello")
    assert piped.stdout == "HELLO"
    assert sandbox.exec("id -u; pwd; hostname").stdout.split() == ["0", "/work", "sandbox"]


def test_exec_timeout_kills_the_command_and_the_sandbox_goes_on(sandbox):
    start = time.monotonic()
    result = sandbox.exec("sleep 100 & sleep 100", timeout=0.5)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - start < 5
    assert "sleep" not in sandbox.exec("ps -e -o comm=").stdout      # the background sleep went too
    assert sandbox.exec("echo alive").stdout == "alive\n"


def test_bad_exec_arguments_are_refused(sandbox):
    with pytest.raises(TypeError, match="shell string or a non-empty list"):
        sandbox.exec([])
    with pytest.raises(ValueError, match="timeout"):
        sandbox.exec("true", timeout=0)
    with pytest.raises(ValueError, match="NUL"):
        sandbox.exec(["echo", "a\0b"])


def test_files_round_trip_and_are_seen_inside(sandbox):
    sandbox.write_file("/work/dir/sub/a.txt", "from host")
    sandbox.write_file("rel.bin", bytes(range(256)))
    assert sandbox.exec("cat /work/dir/sub/a.txt; stat -c %u:%g /work/dir/sub/a.txt").stdout == "from host0:0\n"
    assert sandbox.read_file("/work/rel.bin") == bytes(range(256))
    sandbox.exec("printf inside > /tmp/made")
    assert sandbox.read_file("/tmp/made") == b"inside"
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("/work/missing")
    with pytest.raises(ValueError, match="bad path"):
        sandbox.read_file("")


def test_pause_stops_cpu_and_resume_continues(sandbox):
    from kimik3.agentenv import SandboxError

    sandbox.exec("nohup setsid sh -c 'while :; do :; done' >/dev/null 2>&1 &")
    time.sleep(0.2)
    sandbox.pause()
    assert sandbox.paused
    before = sandbox.cpu_ns()
    time.sleep(0.5)
    assert sandbox.cpu_ns() == before                 # frozen: not one ns of CPU
    with pytest.raises(SandboxError, match="paused"):
        sandbox.exec("true")
    assert sandbox.read_file("/proc/1/comm").startswith(b"python")    # host-side file access still works
    sandbox.resume()
    time.sleep(0.3)
    assert sandbox.cpu_ns() > before + 50_000_000     # the spinning loop runs again
    assert not sandbox.paused


def test_close_ends_everything_and_is_idempotent(make_sandbox):
    import os

    from kimik3.agentenv import SandboxError

    sandbox = make_sandbox()
    sandbox.exec("nohup setsid sleep 1000 >/dev/null 2>&1 &")
    init, cgroup_dirs = sandbox.init_pid, list(sandbox.cgroup.dirs.values())
    sandbox.close()
    sandbox.close()
    assert not os.path.exists(f"/proc/{init}/ns") or open(f"/proc/{init}/stat").read().split()[2] == "Z"
    assert not any(os.path.exists(d) for d in cgroup_dirs)
    with pytest.raises(SandboxError, match="closed"):
        sandbox.exec("true")


def test_missing_facility_is_named(monkeypatch):
    from kimik3.agentenv import MissingFacility, Sandbox, facilities

    monkeypatch.setattr(facilities, "probe", lambda: {"root": "root (effective uid is 1000)", "cgroups": None})
    with pytest.raises(MissingFacility, match=r"root \(effective uid is 1000\)"):
        Sandbox.create()


def test_the_process_store_sweeps_stores_of_dead_processes(tmp_path):
    from kimik3.agentenv import sandbox as module

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, alive = tmp_path / f"checkpoints-{dead.pid}", tmp_path / f"checkpoints-{os.getppid()}"
    for directory in (stale, alive):
        (directory / "blobs").mkdir(parents=True)
    store = module._process_store(str(tmp_path))
    try:
        assert store.directory == str(tmp_path / f"checkpoints-{os.getpid()}")
        assert not stale.exists() and alive.exists()    # a live process keeps its store
        assert module._process_store(str(tmp_path)) is store
    finally:
        module._process_stores.pop(str(tmp_path))
