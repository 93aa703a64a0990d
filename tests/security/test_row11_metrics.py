"""Row 11 of docs/SECURITY.md: any pod that reaches :9400 read every pod's names, ids, pids and
usage, and each connection got a thread with no timeout. Now the base DaemonSet binds the
metrics to the pod's loopback (no other pod reaches them), the monitoring overlay serves them
only over mutual TLS to a client certificate the operator's CA signed (and a NetworkPolicy
lets only the monitoring namespace connect); and the server holds at most 8 connections, each
with a timeout, the TLS handshake included."""
import socket
import ssl
import subprocess
import threading
import time
import urllib.request

import pytest

from convgpu.enforcer.metrics import MetricsServer, Tls

STATUS = {"containers": [{"id": "c" * 64, "name": "victim", "pids": [4242], "limit": 1 << 30, "stalls": 0,
                          "grants": 0, "over_limit_events": 0, "gpus": {"0": {"limit": 1 << 30}}}],
          "gpus": {"0": {"capacity": 4 << 30}}}


def test_a_flood_of_idle_connections_gets_eight_threads_and_then_a_timeout():
    srv = MetricsServer(0, "127.0.0.1")
    srv.publish(STATUS)
    conns = []
    try:
        before = threading.active_count()
        for _ in range(40):
            conns.append(socket.create_connection(("127.0.0.1", srv.port)))
        time.sleep(0.5)
        assert threading.active_count() - before <= 8       # not one thread per connection
    finally:
        for c in conns:
            c.close()
        srv.close()
    srv = MetricsServer(0, "127.0.0.1", timeout=0.5)
    srv.publish(STATUS)
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(8)]
        time.sleep(1.0)                                      # the idle ones are dropped after 0.5 s
        assert all(c.recv(1) == b"" for c in idle)
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5).read().decode()
        assert 'convgpu_container_limit_bytes{container="victim"' in body
    finally:
        srv.close()


def _pki(d):
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d, timeout=60)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=ca")
    for name in ("server", "client", "rogue"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "ext")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "client.pem", "-days", "1")
    run("x509", "-req", "-in", "rogue.csr", "-signkey", "rogue.key", "-out", "rogue.pem", "-days", "1")   # self-signed


def test_mutual_tls_serves_only_the_operators_client_and_a_silent_client_blocks_nobody(tmp_path):
    _pki(tmp_path)
    srv = MetricsServer(0, "127.0.0.1", tls=Tls(str(tmp_path / "server.pem"), str(tmp_path / "server.key"),
                                                str(tmp_path / "ca.pem")), timeout=2.0)
    srv.publish(STATUS)
    url = f"https://127.0.0.1:{srv.port}/metrics"
    try:
        silent = socket.create_connection(("127.0.0.1", srv.port))     # connects, never says hello

        def client(name=None):
            ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
            if name:
                ctx.load_cert_chain(str(tmp_path / f"{name}.pem"), str(tmp_path / f"{name}.key"))
            return ctx
        body = urllib.request.urlopen(url, context=client("client"), timeout=5).read().decode()
        assert 'convgpu_container_limit_bytes{container="victim"' in body   # while `silent` holds its slot
        for who in (None, "rogue"):                                    # no certificate, or not the CA's
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                urllib.request.urlopen(url, context=client(who), timeout=5).read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5).read()   # plain HTTP
        silent.close()
    finally:
        srv.close()
