"""Where built native parts live: `make` puts them in <repo>/build (the package is installed
editable from the repo by scripts/setup.sh); CONVGPU_BUILD overrides."""
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_dir() -> Path:
    return Path(os.environ.get("CONVGPU_BUILD", REPO / "build"))


def standin_libcuda() -> Path:
    return build_dir() / "standin" / "libcuda.so.1"


def shim_library() -> str | None:
    """The preload shim built into the package (setup.py): convgpu/libconvgpu*.so."""
    found = sorted(Path(__file__).resolve().parent.glob("libconvgpu*.so"))
    return str(found[0]) if found else None


def offered_shim(run_dir: str) -> str | None:
    """The copy of the shim that pods mount (kube/agent.py offer_shim): <run_dir>/lib/libconvgpu.so,
    made from the package's when missing or unlike it, else kept as it is. The enforcer and the
    Kubernetes agent both call this, so they agree on one file: the enforcer marks its wrappers
    as the shim's, and discovery never takes it for a driver (it exports the driver's names). A
    replacement is whole: written beside it and renamed over it, under a lock, so a pod starting
    meanwhile mounts one whole library and two callers never make two files. None without a
    built shim. run_dir is root's (no container writes there): nothing here follows a link out."""
    import fcntl
    import filecmp
    import shutil
    src = shim_library()
    if src is None:
        return None
    lib_dir = os.path.join(run_dir, "lib")
    os.makedirs(lib_dir, mode=0o755, exist_ok=True)
    dst = os.path.join(lib_dir, "libconvgpu.so")
    lock = os.open(lib_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(dst) and not os.path.islink(dst) and filecmp.cmp(src, dst, shallow=False):
            return dst
        tmp = os.path.join(lib_dir, f".libconvgpu.so.{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
        return dst
    finally:
        os.close(lock)
