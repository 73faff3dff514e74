"""Fork independence and incremental checkpoint/restore of the writable layer."""

import pytest


def test_fork_sees_parent_files_and_neither_reaches_the_other(make_sandbox):
    parent = make_sandbox()
    parent.exec("echo v1 > /work/state; mkdir -p /work/d; echo gone > /etc/motd; rm /etc/motd")
    parent.exec("nohup setsid sleep 1000 >/dev/null 2>&1 &")
    with parent.fork() as child:
        assert child.exec("cat /work/state").stdout == "v1\n"
        assert child.exec("test -e /etc/motd || echo deleted").stdout == "deleted\n"     # whiteouts copied
        assert "sleep" not in child.exec("ps -e -o comm=").stdout      # processes are not forked here
        child.exec("echo child > /work/state; echo new > /work/only-child")
        parent.exec("echo parent > /work/state")
        assert child.exec("cat /work/state").stdout == "child\n"
        assert parent.exec("cat /work/state; test -e /work/only-child || echo absent").stdout == "parent\nabsent\n"
    assert "sleep" in parent.exec("ps -e -o comm=").stdout               # the parent kept its processes
    assert not parent.paused


def test_forks_of_one_sandbox_boot_concurrently_and_the_parent_runs_on(make_sandbox, monkeypatch):
    # The parent is frozen and locked only while its layer is copied: a second fork may start while the first
    # child is still booting, every child sees the parent's files, and the parent is thawed and usable after.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kimik3.agentenv import isolation

    parent = make_sandbox()
    parent.exec("echo v1 > /work/state")
    both, overlapped = threading.Barrier(2, timeout=5.0), threading.Event()
    real_status = isolation._status

    def slow_status(fd, timeout_s=5.0):   # a child's boot, after its copy: both forks must get here together
        try:
            both.wait()
            overlapped.set()
        except threading.BrokenBarrierError:
            pass
        return real_status(fd, timeout_s)

    monkeypatch.setattr(isolation, "_status", slow_status)

    def fork_and_read(_):
        with parent.fork() as child:
            return child.exec("cat /work/state").stdout

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(fork_and_read, range(2))) == ["v1\n", "v1\n"]
    assert overlapped.is_set()
    assert not parent.paused and parent.exec("cat /work/state").stdout == "v1\n"


def test_checkpoint_is_incremental_and_restore_brings_files_back(make_sandbox):
    sandbox = make_sandbox()
    sandbox.exec("head -c 8000000 /dev/urandom > /work/big; echo one > /work/small")
    first = sandbox.checkpoint()
    assert sandbox.last_checkpoint.bytes_written > 8_000_000
    sandbox.exec("echo two > /work/small; rm /work/big; echo x > /work/new")
    second = sandbox.checkpoint()
    assert sandbox.last_checkpoint.bytes_written < 20_000              # a small change: a small checkpoint
    assert sandbox.last_checkpoint.files_stored == 2
    sandbox.exec("echo three > /work/small")
    sandbox.restore(first)
    assert sandbox.exec("cat /work/small; wc -c < /work/big; test -e /work/new || echo no-new").stdout == \
        "one\n8000000\nno-new\n"
    sandbox.restore(second)
    assert sandbox.exec("cat /work/small /work/new; test -e /work/big || echo no-big").stdout == "two\nx\nno-big\n"
    sandbox.exec("echo four > /work/small")
    sandbox.checkpoint()
    assert sandbox.last_checkpoint.bytes_written < 20_000              # still incremental after a restore
    with pytest.raises(KeyError, match="no checkpoint"):
        sandbox.restore("nope-1")
    with pytest.raises(ValueError, match="bad checkpoint id"):
        sandbox.restore("../../etc/passwd")
    assert sandbox.exec("cat /work/small").stdout == "four\n"          # a refused restore changed nothing


def test_checkpoint_keeps_owner_mode_and_links(make_sandbox):
    sandbox = make_sandbox()
    sandbox.exec("mkdir /work/p && echo s > /work/p/f && chmod 0750 /work/p && chown 1000:2000 /work/p/f && "
                 "chmod 4711 /work/p/f && ln -s f /work/p/link")
    checkpoint = sandbox.checkpoint()
    from kimik3.agentenv import Sandbox

    with Sandbox.from_checkpoint(checkpoint, sandbox.store, limits=sandbox.limits) as copy:
        assert copy.exec("stat -c '%a %u:%g' /work/p /work/p/f; readlink /work/p/link").stdout == \
            "750 0:0\n4711 1000:2000\nf\n"
