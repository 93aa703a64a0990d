"""The copy of the shim that pods mount (paths.offered_shim): one file that the enforcer and the
Kubernetes agent agree on, whole, and never taken for a driver by discovery (probes/identity.py)."""
import os
import threading
from types import SimpleNamespace

import pytest

from convgpu.paths import offered_shim, shim_library
from convgpu.probes.identity import Identity



@pytest.fixture(autouse=True)
def built():
    """The package's shim is built by the install (setup.py): missing, these tests fail, never skip."""
    assert shim_library() is not None, "the shim is not built: run scripts/setup.sh"


def test_made_once_then_kept_and_a_changed_one_replaced(tmp_path):
    path = offered_shim(str(tmp_path))
    assert path == str(tmp_path / "lib" / "libconvgpu.so")
    assert open(path, "rb").read() == open(shim_library(), "rb").read()
    assert os.stat(path).st_mode & 0o777 == 0o755
    ino = os.stat(path).st_ino
    assert offered_shim(str(tmp_path)) == path and os.stat(path).st_ino == ino   # kept: marks stay valid
    with open(path, "r+b") as f:           # unlike the package's (an older build): replaced whole
        f.write(b"\0" * 16)
    assert offered_shim(str(tmp_path)) == path
    assert open(path, "rb").read() == open(shim_library(), "rb").read()
    assert os.listdir(tmp_path / "lib") == ["libconvgpu.so"]   # no temporary left behind


def test_callers_at_once_leave_one_file(tmp_path):
    inodes = []
    threads = [threading.Thread(target=lambda: inodes.append(os.stat(offered_shim(str(tmp_path))).st_ino))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(inodes)) == 1 and os.stat(tmp_path / "lib" / "libconvgpu.so").st_ino == inodes[0]


def test_a_link_in_place_of_the_lib_dir_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "lib")
    with pytest.raises(OSError):
        offered_shim(str(tmp_path))
    assert os.listdir(tmp_path / "elsewhere") == []


def test_discovery_never_takes_the_enforcers_shims_for_drivers(tmp_path):
    offered = offered_shim(str(tmp_path))
    tracer = SimpleNamespace(shims=())
    ident = Identity(SimpleNamespace(tracer=tracer))
    st = os.stat(shim_library())
    assert ident.skip() == {(st.st_dev, st.st_ino)}          # before the enforcer says: the package's
    tracer.shims = (shim_library(), offered)
    o = os.stat(offered)
    assert ident.skip() == {(st.st_dev, st.st_ino), (o.st_dev, o.st_ino)}
