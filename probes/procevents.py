"""Exec and exit of processes without eBPF: the kernel's process connector (netlink,
CONFIG_PROC_EVENTS), through pyroute2's ProcEventSocket. The shim-only enforcer
(`--no-probes`, probes/ledger.py) needs exec above all: an exec replaces the image, the driver
closes its files and frees the device memory, and the new image under the shim starts again
with its own hello, as BPF's sched_process_exec tracepoint tells the probes. A pidfd sees the
exit but never an exec.

The connector reports every fork, exec and exit on the host; only exec is kept (the ledger's
pidfds see exits, and need no capability).
Events lost to a full socket buffer (ENOBUFS) are made up for by an image fingerprint read
from /proc (`image_of`), which the ledger compares for the processes it follows."""
import errno
import logging
import socket

log = logging.getLogger(__name__)

RCVBUF = 4 << 20     # a burst of forks on a busy host must not overflow it before a poll


def image_of(pid: int) -> tuple[int, int] | None:
    """What changes when pid execs and never otherwise: the start of its stack and of its code
    (/proc/PID/stat fields 26 and 28, placed anew, with ASLR, by every exec). None: gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read(4096).rsplit(b")", 1)[1].split()
        return int(fields[23]), int(fields[25])   # startcode, startstack (fields 26, 28; 3 is [0])
    except (OSError, IndexError, ValueError):
        return None


class ProcEvents:
    """open() -> self, or None with the reason logged once (no CAP_NET_ADMIN, no
    CONFIG_PROC_EVENTS); fileno() for epoll; read() -> (tgids that exec'd, lost) with lost True
    when the kernel dropped events since the last read. pyroute2 knows the connector's messages (encoding the listen
    request, decoding events); the socket is a plain non-blocking one of ours, since pyroute2's
    own sockets read through an asyncio loop that would block the enforcer's."""

    def __init__(self):
        self.sock = None
        self.marshal = None

    def open(self) -> "ProcEvents | None":
        try:
            from pyroute2.netlink import NETLINK_CONNECTOR, NLMSG_DONE
            from pyroute2.netlink.connector import cn_proc
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                              NETLINK_CONNECTOR)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
                s.bind((0, cn_proc.CN_IDX_PROC))
                m = cn_proc.proc_event_control()
                m["header"]["type"] = NLMSG_DONE
                m["header"]["pid"] = s.getsockname()[0]
                m["idx"], m["val"] = cn_proc.CN_IDX_PROC, cn_proc.CN_VAL_PROC
                m["len"], m["action"] = 4, cn_proc.PROC_CN_MCAST_LISTEN
                m.encode()
                s.send(m.data)
            except OSError:
                s.close()
                raise
        except (OSError, ImportError) as e:
            log.warning("no process connector (%s): an exec under the shim is seen at the next "
                        "check of the processes' images, up to a second late", e)
            return None
        self.sock, self.marshal = s, cn_proc.ProcEventMarshal()
        return self

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> tuple[list[int], bool]:
        out, lost = [], False
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return out, lost
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                lost = True
                continue
            out += [m.get("process_tgid") for m in self.marshal.parse(data) if m.get("event") == "PROC_EVENT_EXEC"]

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None
