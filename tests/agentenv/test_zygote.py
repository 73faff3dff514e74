"""REPLs forked from a preloaded zygote into sandboxes: inside the sandbox, sharing the preload."""


def test_zygote_repl_runs_inside_the_sandbox_with_the_preload(make_sandbox):
    from kimik3.agentenv.zygote import Zygote

    sandbox = make_sandbox()
    sandbox.write_file("/work/inside.txt", "seen from the REPL")
    with Zygote("table = list(range(100000))\nimport json") as zygote:
        repl = zygote.spawn(sandbox)
        try:
            assert repl.run("print(len(table), json.dumps([1]))").strip() == "100000 [1]"
            assert repl.run("print(open('/work/inside.txt').read())").strip() == "seen from the REPL"
            assert repl.run("import os; print(os.getuid(), os.getpid() < 100)").strip() == "0 True"
            assert repl.run("print(os.path.exists('/work/main'))").strip() == "False"
            assert repl.run("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                            "except OSError as e:\n    print('blocked')").strip() == "blocked"
            assert repl.run("1/0").startswith("ZeroDivisionError")
            assert repl.run("table.append(1); print(len(table))").strip() == "100001"   # the REPL's own copy
            assert "python" in sandbox.exec("ps -e -o comm=").stdout
        finally:
            repl.close()
