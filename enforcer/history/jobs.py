"""Who a job is: the identity its runs are kept under (docs/RECOMMEND.md, "Jobs").

A job's name is chosen by whoever starts it (a container's name, `convgpu run --name`, a pod's
owner), so it is hostile text: it never reaches a file, a table or a metric label as given.
- The key is `<kind>:<name>`, where the kind is ours (where the name came from), never the
  tenant's: a container named `run:train` is `podman:run%3Atrain`, not the `convgpu run` job
  `train`. A Kubernetes job's name starts with its namespace (`k8s:<ns>/<Kind>/<owner>/<container>`),
  and a pod can name only owners in its own namespace, so no tenant reaches another
  namespace's history by choosing a name.
- The name is percent-encoded (RFC 3986 unreserved characters and `/` are kept; everything
  else, markup, quotes, spaces, newlines included, becomes %XX): the mapping is one to one, so
  two names never share a key, and what is shown contains no markup. A name longer than
  MAX_NAME is cut and ends in a hash of the whole, so it stays distinct too.
- The scope is what the history's caps are shared by (store.py: a full history drops the oldest
  job of the scope that holds the most): a namespace for Kubernetes, else the kind."""
import hashlib
import re
from dataclasses import dataclass
from urllib.parse import quote

MAX_NAME = 160        # characters of an encoded name (a DNS subdomain is 253; a key must fit a label)
RUN_PARENT = "/convgpu.run/"   # `convgpu run`'s cgroups (cli/run.py)
_ENCODED = re.compile(r"[A-Za-z0-9_.~/%-]+")   # what safe() can give
KINDS = ("run", "k8s", "docker", "containerd", "kubernetes", "crio", "podman", "systemd", "cgroup", "host")


@dataclass(frozen=True)
class Job:
    kind: str
    name: str          # encoded (safe())

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def scope(self) -> str:
        return f"k8s:{self.name.split('/', 1)[0]}" if self.kind == "k8s" else self.kind


def safe(text: str) -> str:
    """text percent-encoded (one to one), at most MAX_NAME characters (a longer one cut, with a
    hash of the whole at its end)."""
    out = quote(str(text), safe="/")
    if len(out) > MAX_NAME:
        out = out[:MAX_NAME - 17].rstrip("%0123456789ABCDEF") + "~" + hashlib.sha256(out.encode()).hexdigest()[:16]
    return out or "%00"


def parse_key(key: str) -> Job:
    """A key as the file keeps it; ValueError if it is not one a Job could have made."""
    kind, sep, name = key.partition(":")
    if not sep or kind not in KINDS or len(name) > MAX_NAME or not _ENCODED.fullmatch(name):
        raise ValueError(f"job key {key[:80]!r}")
    return Job(kind, name)


def identify(kind: str, cid: str, cgroup: str, name: str | None = None, run_name: str | None = None,
             pod_job: str = "") -> Job:
    """The job a container's run belongs to: the Kubernetes agent's owner (`pod_job`:
    namespace/Kind/owner/container), else `convgpu run --name` (run_name, for a cgroup under
    /convgpu.run), else the engine's name for the container, else the container itself (an
    unnamed container is a job of one run)."""
    if pod_job:
        return Job("k8s", safe(pod_job))
    if run_name and cgroup.startswith(RUN_PARENT):
        return Job("run", safe(run_name))
    k = kind if kind in KINDS else "cgroup"
    if k in ("cgroup", "host"):
        return Job(k, safe(cgroup))
    return Job(k, safe(name or cid))
