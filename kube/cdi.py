"""A claim's CDI spec (issue 48): what the runtime adds to each container that names the claim,
and the checks a runtime makes of it before it accepts it, made here before Prepare answers.

The spec (`<cdi dir>/convgpu-claim-<uid>.json`, kind `convgpu.io/claim`):
- per device (one per GPU of the claim): the GPU's device nodes as the agent sees them under its
  device root, and `NVIDIA_VISIBLE_DEVICES=void`, as NVIDIA's own CDI specs set it: the legacy
  runtime hook (the `nvidia` runtime) then adds no GPU, where an image's
  `NVIDIA_VISIBLE_DEVICES=all` would have made it add every GPU of the node;
- for the claim: `CONVGPU_DRA_CLAIM`, and where the claim holds memory (not adminAccess) the
  preload shim's library and socket dir, read-only, with its environment and the claim's size
  (`CONVGPU_GPU_MEMORY_LIMIT`): cudaMemGetInfo then reports the claim (docs/SHIM.md).
The driver's libraries are not in it: they come from NVIDIA's CDI spec on the node (`nvidia-ctk
cdi generate`), whose device `nvidia.com/gpu=<uuid>` Prepare names beside ours (--cdi).

validate() is the container-device-interface library's own check (tags.cncf.io/container-device-
interface, pkg/cdi spec.go, device.go, container-edits.go, pkg/parser, specs-go version.go),
written out: containerd and CRI-O refuse a spec that fails it when they create the container, so
a claim whose spec fails it is refused at Prepare instead (before, a GPU without device nodes
under the root gave `"deviceNodes": []`, which the library refuses as "invalid device, empty
device edits", and Prepare answered OK). The version a spec declares is the least its contents
need (the library's MinimumRequiredVersion), so a runtime with an older library reads it too.
Pure, but for the device nodes looked for under the root."""
import json
import os
import re
import tempfile

from . import devices as dv

DIR = "/var/run/cdi"           # a runtime's CDI dir for specs made at run time
KIND = "convgpu.io/claim"      # vendor/class of the per-claim specs
VOID = "NVIDIA_VISIBLE_DEVICES=void"
# the released versions (specs-go/version.go), oldest first; the library reads 0.3.0 and later
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_FIELDS = {"spec": {"cdiVersion", "kind", "annotations", "devices", "containerEdits"},
           "device": {"name", "annotations", "containerEdits"},
           "edits": {"env", "deviceNodes", "netDevices", "hooks", "mounts", "intelRdt", "additionalGids"},
           "node": {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"},
           "mount": {"hostPath", "containerPath", "options", "type"},
           "hook": {"hookName", "path", "args", "env", "timeout"}}
_HOOKS = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
_VENDOR = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_CLASS = _VENDOR
_DEVICE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


class CdiDir:
    """One spec per claim, <dir>/convgpu-claim-<uid>.json, written whole (temporary file and
    rename: the runtime reads the old spec or the new one, never half)."""

    def __init__(self, path: str = DIR):
        self.dir = path

    def path(self, uid: str) -> str:
        return os.path.join(self.dir, f"convgpu-claim-{uid}.json")   # uid checked (claims.check_request)

    def write(self, uid: str, spec: dict):
        os.makedirs(self.dir, mode=0o755, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".convgpu-claim-", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(spec, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path(uid))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def remove(self, uid: str):
        try:
            os.unlink(self.path(uid))
        except FileNotFoundError:
            pass


class CdiError(ValueError):
    """A spec a runtime would refuse: one line, as the library says it."""


def name(claim, r) -> str:
    """A device's name in the claim's spec (a digit may start it: version 0.5.0 and later)."""
    return f"{claim.uid}-{r.device}"


def spec(claim, dev_root: str = "/dev", shim: dv.ShimOffer | None = None) -> dict:
    """The claim's spec (kube/claims.py Claim), its version the least it needs."""
    charged = bool(claim.gpus())
    env = {"CONVGPU_DRA_CLAIM": claim.ref}
    mounts = []
    if charged:
        env["CONVGPU_GPU_MEMORY_LIMIT"] = str(sum(claim.gpus().values()))
        if shim is not None:
            env.update(shim.envs())
            mounts = [{"hostPath": h, "containerPath": c, "options": ["ro", "nosuid", "nodev", "bind"]}
                      for c, h in shim.mounts()]
    devices, seen = [], set()
    for r in claim.results:
        if r.device in seen:   # two results on one GPU: one CDI device
            continue
        seen.add(r.device)
        nodes = [f"/dev/nvidia{r.gpu.index if r.gpu.minor is None else r.gpu.minor}", *dv.CONTROL_NODES]
        edits = {"env": [VOID], "deviceNodes": [
            {"path": n, "hostPath": os.path.join(dev_root, os.path.basename(n))} for n in nodes
            if os.path.exists(os.path.join(dev_root, os.path.basename(n)))]}
        devices.append({"name": name(claim, r), "containerEdits": {k: v for k, v in edits.items() if v}})
    out = {"cdiVersion": "", "kind": KIND, "devices": devices,
           "containerEdits": {"env": [f"{k}={v}" for k, v in sorted(env.items())]} | ({"mounts": mounts} if mounts else {})}
    out["cdiVersion"] = minimum_version(out)
    return out


def minimum_version(s: dict) -> str:
    """The least version whose rules allow what the spec uses (the library's requiredVersion)."""
    edits = [s.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in s.get("devices") or []]
    devices = s.get("devices") or []
    if any(e.get("netDevices") or (e.get("intelRdt") or {}).get("schemata") or
           (e.get("intelRdt") or {}).get("enableMonitoring") for e in edits):
        return "1.1.0"
    if any("intelRdt" in e or e.get("additionalGids") for e in edits):
        return "0.7.0"
    if s.get("annotations") or any(d.get("annotations") for d in devices) or "." in str(s.get("kind")).partition("/")[2]:
        return "0.6.0"
    if any(str(d.get("name", ""))[:1].isdigit() for d in devices) or \
            any(n.get("hostPath") for e in edits for n in e.get("deviceNodes") or ()):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts") or ()):
        return "0.4.0"
    return "0.3.0"


def validate(s) -> None:
    """CdiError where a runtime's CDI library would refuse the spec: its fields (decoded
    strictly: no field it does not know), its version (known, and at least what its contents
    need), its kind, its devices (at least one, names valid and distinct, none with empty
    edits) and every edit (env as KEY=VALUE, device nodes with a path and a known type and
    permissions, mounts with both paths, hooks of a known name with a path)."""
    _fields(s, "spec", "spec")
    version = str(s.get("cdiVersion", "")).removeprefix("v")
    if version not in VERSIONS:
        raise CdiError(f"invalid version {s.get('cdiVersion')!r}")
    need = minimum_version(s)
    if VERSIONS.index(need) > VERSIONS.index(version):
        raise CdiError(f"the spec version must be at least v{need}")
    vendor, sep, klass = str(s.get("kind", "")).partition("/")
    if not sep or not _VENDOR.fullmatch(vendor) or not _CLASS.fullmatch(klass):
        raise CdiError(f"invalid kind {s.get('kind')!r} (vendor/class)")
    _edits(s.get("containerEdits") or {}, "spec")
    devices = s.get("devices")
    if not isinstance(devices, list) or not devices:
        raise CdiError("invalid spec, no devices")
    names = set()
    for d in devices:
        _fields(d, "device", "device")
        n = d.get("name")
        if not isinstance(n, str) or not _DEVICE.fullmatch(n):
            raise CdiError(f"invalid device name {str(n)[:80]!r}")
        if n in names:
            raise CdiError(f"invalid spec, multiple device {n!r}")
        names.add(n)
        edits = d.get("containerEdits")
        if not isinstance(edits, dict) or not any(edits.get(k) for k in _FIELDS["edits"]):
            raise CdiError(f"failed add device {n!r}: invalid device, empty device edits")
        _edits(edits, f"device {n!r}")


def _fields(obj, what: str, where: str):
    if not isinstance(obj, dict):
        raise CdiError(f"{where}: not an object")
    extra = set(obj) - _FIELDS[what]
    if extra:
        raise CdiError(f"{where}: unknown field {sorted(extra)[0]!r}")


def _strings(v, where: str) -> list:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise CdiError(f"{where}: not a list of strings")
    return v


def _env(v, where: str):
    for e in _strings(v, where):
        if e.find("=") <= 0:
            raise CdiError(f"{where}: invalid environment variable {e[:80]!r}")


def _edits(e, where: str):
    _fields(e, "edits", where)
    _env(e.get("env"), f"{where} env")
    for n in e.get("deviceNodes") or ():
        _fields(n, "node", f"{where} device node")
        if not isinstance(n.get("path"), str) or not n["path"]:
            raise CdiError(f"{where}: invalid (empty) device path")
        if n.get("type", "") not in ("", "b", "c", "u", "p"):
            raise CdiError(f"{where}: device {n['path']!r}: invalid type {n.get('type')!r}")
        perm = n.get("permissions", "")
        if not isinstance(perm, str) or (perm not in ("", "none") and perm.strip("rwm")):
            raise CdiError(f"{where}: device {n['path']!r}: invalid permissions {perm!r}")
    for m in e.get("mounts") or ():
        _fields(m, "mount", f"{where} mount")
        for k in ("hostPath", "containerPath"):
            if not isinstance(m.get(k), str) or not m[k]:
                raise CdiError(f"{where}: invalid mount, empty {'host' if k == 'hostPath' else 'container'} path")
        _strings(m.get("options"), f"{where} mount options")
    for h in e.get("hooks") or ():
        _fields(h, "hook", f"{where} hook")
        if h.get("hookName") not in _HOOKS:
            raise CdiError(f"{where}: invalid hook name {str(h.get('hookName'))[:40]!r}")
        if not isinstance(h.get("path"), str) or not h["path"]:
            raise CdiError(f"{where}: invalid hook {h['hookName']!r} with empty path")
        _strings(h.get("args"), f"{where} hook args")
        _env(h.get("env"), f"{where} hook {h['hookName']!r} env")
