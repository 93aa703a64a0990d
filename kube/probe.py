"""The DaemonSet's liveness and readiness probes, as small as a probe run every few seconds
should be (no CLI, no gRPC import: about 0.05 s of CPU):

  python3 -m convgpu.kube.probe enforcer [RUN_DIR]     the enforcer's loop answers a ping
  python3 -m convgpu.kube.probe plugin [PLUGIN_DIR]     our device-plugin socket accepts
  python3 -m convgpu.kube.probe dra [PLUGINS_DIR]       our DRA plugin's socket accepts (--dra)

The enforcer's control socket is served by its loop, so a ping answered within 3 s says the
loop runs (its heartbeat thread stops beating for a loop hung `hung` s; docs/ENFORCE.md). The
plugin's socket is made only after a kubelet was found, and is made again after a kubelet
restart removes it (kube/plugin.py): readiness means registered or about to be."""
import json
import os
import socket
import sys


def _connect(path: str, timeout: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def enforcer(run_dir: str = "/run/convgpu", timeout: float = 3.0) -> str:
    with _connect(os.path.join(run_dir, "control.sock"), timeout) as s:
        s.sendall(b'{"cmd": "ping"}\n')
        buf = b""
        while not buf.endswith(b"\n") and len(buf) < 65536:
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    reply = json.loads(buf)
    if not reply.get("ok"):
        raise RuntimeError(f"ping: {reply}")
    return f"enforcer pid {reply.get('pid')} answers"


def plugin(plugin_dir: str = "/var/lib/kubelet/device-plugins", timeout: float = 3.0) -> str:
    path = os.path.join(plugin_dir, "convgpu.sock")
    _connect(path, timeout).close()
    return f"{path} accepts"


def dra(plugins_dir: str = "/var/lib/kubelet/plugins", timeout: float = 3.0) -> str:
    path = os.path.join(plugins_dir, "gpu-memory.convgpu.io", "dra.sock")
    _connect(path, timeout).close()
    return f"{path} accepts"


def main(argv: list[str]) -> int:
    what = {"enforcer": enforcer, "plugin": plugin, "dra": dra}
    if not argv or argv[0] not in what:
        print("usage: python3 -m convgpu.kube.probe enforcer|plugin|dra [DIR]", file=sys.stderr)
        return 2
    try:
        print(what[argv[0]](*argv[1:2]))
        return 0
    except (OSError, ValueError, RuntimeError) as e:
        print(f"{argv[0]}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
