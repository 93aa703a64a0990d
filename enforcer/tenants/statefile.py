"""One file of the state dir (decisions.json, history.jsonl), as the kubelet keeps its
checkpoints (STYLE.md 17): written whole (a temporary file, fsync, rename, fsync of the
directory), read with caps (a regular file, never through a symlink, at most a size) and
checked (a format name, a version, a checksum over its body) before any of it is believed."""
import hashlib
import json
import os
import stat
import tempfile

from ...errors import ConvgpuError

MAX_BYTES = 16 << 20     # read_file's cap unless the caller gives one


class Unreadable(ConvgpuError):
    """The file is there and cannot be used: corrupt, a newer format, not a regular file."""


def digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checked_body(raw: bytes, fmt: str, newest: int, key: str) -> tuple[int, dict]:
    """(version, body) of a state-dir document: JSON with this format name, a version up to
    `newest`, and its body under `key` matching its checksum; else Unreadable, in one line."""
    doc = loads(raw)
    version = checked_header(doc, fmt, newest)
    body = doc.get(key)
    if not isinstance(body, dict) or doc.get("sha256") != digest(body):
        raise Unreadable(f"its checksum does not match its {key} (changed or cut short)")
    return version, body


def loads(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise Unreadable(f"not JSON ({e})") from None


def checked_header(doc, fmt: str, newest: int) -> int:
    """The version of a document (or a file's header line) that names this format and a version
    up to `newest`; else Unreadable, in one line."""
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise Unreadable(f"not a {fmt} file")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise Unreadable(f"format version {version!r} is not one")
    if version > newest:
        raise Unreadable(f"written by a newer convgpu (format version {version}; this one reads up to {newest})")
    return version


def read_file(path: str, cap: int = MAX_BYTES, what: str = "a decisions file") -> bytes:
    """The file's bytes: a regular file (never through a symlink), at most `cap`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable("not a regular file")
        if st.st_size > cap:
            raise Unreadable(f"{st.st_size} bytes, more than {what} holds ({cap})")
        chunks, left = [], cap + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_whole(path: str, data: bytes, prefix: str, before_rename=lambda: None):
    """Temporary file in the same directory, fsync, rename over the file, fsync the
    directory: after a crash at any point the file is the old value or the new one."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=d)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        before_rename()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
