"""Helpers of the shim-socket attacks (issue 24 rows 2, 5, 6, 9, 12): an attacker is a python3
run as `nobody` inside a cgroup of the test, against a real `convgpu enforce` on the stand-in."""
import os

from conftest import Enforcing, popen_in

NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")
PY = "/usr/bin/python3"   # the system's: nobody needs no venv to open sockets


def enforcer(build, *args, **kw) -> Enforcing:
    """An enforcer whose shim socket `nobody` can reach (the tests' run dirs are 0700)."""
    enf = Enforcing(build, *args, **kw)
    os.chmod(enf.run_dir, 0o755)
    return enf


def shim_sock(enf) -> str:
    return f"{enf.run_dir}/shim/shim.sock"


def as_nobody(cg, code: str, *args, env=None):
    """python3 -c code as nobody, inside cgroup cg; pipes (text) as popen_in."""
    return popen_in(cg, *NOBODY, PY, "-c", code, *args, env=env)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) << 10 for x in f if x.startswith("VmRSS:"))


def lines_of(enf, text: str) -> list[str]:
    return [x for x in enf.log if text in x]


def flag_line(enf, cg) -> str:
    """Makes the enforcer log a line after everything before it (a hello from a fresh process
    in cgroup cg) and returns its text: what the log held before it has all been read then."""
    p = popen_in(cg, PY, "-c", "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
                 "s.sendall(b'{\"op\":\"hello\"}\\n'); s.recv(4096)", shim_sock(enf))
    p.wait(timeout=30)
    return f"pid {p.pid} of "


def say(p, line: str = ""):
    p.stdin.write(line + "\n")
    p.stdin.flush()


def expect(p, word: str, timeout: float = 60) -> list[str]:
    """The attacker's next stdout line, split; it must start with `word`."""
    from conftest import lines_until
    got: list = []
    try:
        line = lines_until(p.stdout, lambda x: x.split()[:1] == [word], got, timeout, f"attacker {p.pid}")
    except AssertionError as e:
        if p.poll() is None or p.stderr is None:
            raise
        raise AssertionError(f"{e}; it exited {p.returncode}, stderr: {p.stderr.read()[-2000:]!r}") from None
    return line.split()


