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
