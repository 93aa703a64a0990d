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
- A container of a user's own (in systemd's `/user.slice/user-UID.slice`: a login session, the
  user's units, rootless podman) is that user's job: its key's kind says so (`podman@1000:web`).
  That path is named by root alone (tenants/containers.py `delegation_cut`: a container ends at
  the outermost cgroup delegated to anyone, so no name below it reaches its path), never by the
  tenant: a name cannot say whose job it is (its `@` is encoded).
- The scope is what the history's caps are shared by (store.py: a full history drops the oldest
  job of the scope that holds the most): a namespace for Kubernetes, a user for a user's jobs
  (issue 47: one scope per kind let one user's invented names evict every other user's jobs),
  else the kind."""
import hashlib
import re
from dataclasses import dataclass
from urllib.parse import quote

MAX_NAME = 160        # characters of an encoded name (a DNS subdomain is 253; a key must fit a label)
RUN_PARENT = "/convgpu.run/"   # `convgpu run`'s cgroups (cli/run.py)
_ENCODED = re.compile(r"[A-Za-z0-9_.~/%-]+")   # what safe() can give
_USER = re.compile(r"/user\.slice/user-([0-9]+)\.slice(?:/|$)")   # systemd's slice of a user (root makes it)
_KIND = re.compile(r"([a-z0-9]+)(?:@(0|[1-9][0-9]{0,9}))?")         # a key's kind, with its user
KINDS = ("run", "k8s", "docker", "containerd", "kubernetes", "crio", "podman", "systemd", "cgroup", "host")


@dataclass(frozen=True)
class Job:
    kind: str
    name: str          # encoded (safe())
    user: int | None = None   # the uid whose slice the container is in; None: the host's

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}" if self.user is None else f"{self.kind}@{self.user}:{self.name}"

    @property
    def scope(self) -> str:
        if self.kind == "k8s":
            return f"k8s:{self.name.split('/', 1)[0]}"
        return self.kind if self.user is None else f"user:{self.user}"


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
    m = _KIND.fullmatch(kind)
    if (not sep or m is None or m.group(1) not in KINDS or len(name) > MAX_NAME or not _ENCODED.fullmatch(name)
            or (m.group(2) is not None and m.group(1) in ("k8s", "run"))):
        raise ValueError(f"job key {key[:80]!r}")
    return Job(m.group(1), name, None if m.group(2) is None else int(m.group(2)))


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
    m = _USER.match(cgroup)
    user = int(m.group(1)) if m and len(m.group(1)) <= 10 else None
    if k in ("cgroup", "host"):
        return Job(k, safe(cgroup), user)
    return Job(k, safe(name or cid), user)
