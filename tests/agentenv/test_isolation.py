"""Escapes that must fail: host processes, host files, the network, the read-only base, privileges."""

import os
import socket
import subprocess
import threading

import pytest


def test_cannot_see_or_signal_host_processes(sandbox):
    host = subprocess.Popen(["sleep", "60"])
    try:
        pids = sandbox.exec("ls /proc | grep -E '^[0-9]+$'").stdout.split()
        assert str(host.pid) not in pids and max(int(p) for p in pids) < 100      # only its own pid namespace
        killed = sandbox.exec(f"kill -9 {host.pid}; echo $?")
        assert killed.stdout.strip() != "0"
        assert host.poll() is None                                                # the host process lives
        assert sandbox.exec("kill -9 -1; echo $?").exit_code is not None
        assert host.poll() is None
    finally:
        host.kill()
        host.wait()


def test_cannot_read_host_files_outside_its_root(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    for path in (str(secret), "/work/main/pyproject.toml", "/root/.bashrc", "/etc/shadow", f"/proc/1/root{secret}"):
        result = sandbox.exec(["cat", path])
        assert result.exit_code != 0 and "host secret" not in result.stdout, path
    assert "host secret" not in sandbox.exec("grep -rs 'host secret' /work /tmp /home /var /run /mnt").stdout
    sandbox.exec(f"ln -s {secret} /work/link; ln -s ../../../../../../{secret} /work/rel")
    for link in ("/work/link", "/work/rel"):                  # host-side reads resolve inside the root
        with pytest.raises(FileNotFoundError):
            sandbox.read_file(link)
    with pytest.raises(FileNotFoundError):                   # the link's target dir exists on the host only
        sandbox.write_file("/work/link", "written through")
    assert secret.read_text() == "host secret"


def test_no_network_but_the_allowed_loopback_service(make_sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    host_port = server.getsockname()[1]

    def serve():
        for _ in range(2):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"hello from the host service\n")

    threading.Thread(target=serve, daemon=True).start()
    sandbox = make_sandbox(allow=[(8080, host_port)])
    probe = ("import socket,sys\nfor host, port in [(sys.argv[1], int(sys.argv[2]))]:\n"
             "    try:\n        s = socket.create_connection((host, port), timeout=2)\n"
             "        print('connected', s.recv(100).decode().strip())\n"
             "    except OSError as err:\n        print('refused', err.errno)\n")
    sandbox.write_file("/work/probe.py", probe)
    allowed = sandbox.exec(["python3", "/work/probe.py", "127.0.0.1", "8080"])
    assert allowed.stdout.strip() == "connected hello from the host service"
    for host, port in (("1.1.1.1", "53"), ("10.0.0.1", "80"), ("127.0.0.1", str(host_port))):
        assert sandbox.exec(["python3", "/work/probe.py", host, port]).stdout.startswith("refused"), (host, port)
    interfaces = sandbox.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1").stdout.split()
    assert interfaces == ["lo"]
    server.close()


def test_base_image_is_read_only_and_writes_stay_in_the_layer(make_sandbox):
    one, two = make_sandbox(), make_sandbox()
    result = one.exec("echo changed > /etc/hostname && echo x > /usr/bin/made && rm /bin/ls && cat /etc/hostname")
    assert result.exit_code == 0 and result.stdout == "changed\n"
    assert open("/etc/hostname").read() != "changed\n" and not os.path.exists("/usr/bin/made")
    assert os.path.exists("/usr/bin/ls")
    assert two.exec("cat /etc/hostname").stdout != "changed\n"
    assert two.exec("test -e /usr/bin/made || echo absent").stdout == "absent\n"
    assert one.exec("test -e /bin/ls || echo deleted").stdout == "deleted\n"


def test_no_privilege_over_mounts_or_namespaces(sandbox):
    for cmd in ("mount -t tmpfs none /mnt", "umount /proc", "mount -o remount,rw /", "chroot / true",
                "echo 1 > /proc/sys/vm/drop_caches", "ip link add x type dummy", "mknod /tmp/sda b 8 0"):
        assert sandbox.exec(cmd).exit_code != 0, cmd
    caps = sandbox.exec("grep CapEff /proc/self/status").stdout.split()[1]
    assert int(caps, 16) & (1 << 21) == 0                          # no CAP_SYS_ADMIN
    # what the sandbox's root is on the host: an unprivileged id
    assert sandbox.exec("cat /proc/self/uid_map").stdout.split()[:2] == ["0", "100000"]
