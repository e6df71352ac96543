"""Checks on the path parameters: when a value is set, and again at configure, before the model loads.

Why it exists: a path that cannot work must fail the configure with its reason, not surface at
cleanup when the pool is already lost, and the node must never write into a file or folder that
belongs to someone else.

- persist_path (pool snapshots): a directory the node can write. Absent: created at configure. If it
  exists it must be empty or already the pool's (it holds kv_pool.safetensors or .partial); a folder
  full of other things ("/", a home directory) is refused. At configure a temp file is written and
  removed in it, so a read-only mount or a full quota is found then.
- semantic_log_path (decision log): absent, or a regular file that is empty or starts with one of our
  JSON records ({"time": ..., "tier": ...}); the same for its rotated copies (.1, .2, .3), which
  rotation would overwrite. Its folder must be writable.
- warmup_queries: a number N (the N most-used tasks), or an existing regular file (no FIFO), readable,
  at most 64 MB.
- thermal_root: an existing directory. Only the default /sys/class/thermal may be missing (a
  machine without thermal zones), which /diagnostics then reports as "no thermal data".

`check(name, value, create)` raises SettingError naming the parameter; "" always passes (feature off).
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile

from .safe_io import describe_error, open_regular
from .settings import SPEC_BY_NAME, SettingError

PATH_PARAMS = ("persist_path", "semantic_log_path", "warmup_queries", "thermal_root")
SNAPSHOT_NAMES = ("kv_pool.safetensors", ".partial")  # persistence.FILENAME, persistence.PARTIAL_DIR
LOG_BACKUPS = 3  # SemanticLog's backupCount
MAX_WARMUP_BYTES = 64 * 2**20


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _writable_dir(name: str, path: str, what: str) -> None:
    """path (or, if absent, its nearest existing ancestor) is a directory we may create files in."""
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        raise SettingError(f"{name} {path!r}: {base} is not a directory, so {what} cannot be created")
    if not os.access(base, os.W_OK | os.X_OK):
        raise SettingError(f"{name} {path!r}: {base} is not writable by this process")


def _stat(name: str, path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise SettingError(f"{name} {path!r}: a dangling symbolic link") from None
        return None
    except OSError as e:
        raise SettingError(f"{name} {path!r}: {describe_error(e)}") from None


def check_persist_path(path: str, create: bool = False) -> None:
    name = "persist_path"
    st = _stat(name, path)
    if st is None:
        _writable_dir(name, path, "the snapshot folder")
        if not create:
            return
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise SettingError(f"{name} {path!r}: cannot create the folder: {describe_error(e)}") from None
    elif not stat.S_ISDIR(st.st_mode):
        raise SettingError(f"{name} {path!r} exists and is not a directory; it must be a folder for the pool "
                           "snapshot")
    else:
        try:
            names = os.listdir(path)
        except OSError as e:
            raise SettingError(f"{name} {path!r}: cannot list it: {describe_error(e)}") from None
        if names and not any(n in SNAPSHOT_NAMES for n in names):
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise SettingError(f"{name} {path!r} already holds {len(names)} entries that are not a pool snapshot "
                               f"({shown}): give the pool a folder of its own (it is created if absent)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise SettingError(f"{name} {path!r} is not writable by this process")
        snap = os.path.join(path, SNAPSHOT_NAMES[0])
        if os.path.isdir(snap) and not os.path.islink(snap):
            raise SettingError(f"{name}: {snap} is a directory, so no snapshot could ever be saved; remove it")
    if create:  # a real write: catches read-only mounts, full disks and quotas now, not at cleanup
        partial = os.path.join(path, ".partial")
        try:
            if os.path.lexists(partial) and not (os.path.isdir(partial) and not os.path.islink(partial)):
                os.unlink(partial)
            os.makedirs(partial, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix="probe.", suffix=".tmp", dir=partial)
            try:
                os.write(fd, b"probe")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(tmp)
        except OSError as e:
            raise SettingError(f"{name} {path!r}: cannot write a snapshot there: {describe_error(e)}") from None


def _log_is_ours(path: str) -> tuple[bool, str]:
    """(ours, why not): a regular file that is empty or whose first line is one of our JSON records."""
    try:
        fd = open_regular(path)
    except OSError as e:
        return False, describe_error(e)
    try:
        head = os.read(fd, 65536)
    finally:
        os.close(fd)
    if not head:
        return True, ""
    line = head.split(b"\n", 1)[0]
    try:
        rec = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False, "its first line is not one of our JSON records"
    if isinstance(rec, dict) and "time" in rec and "tier" in rec:
        return True, ""
    return False, "its first line is not a simllm_ros decision record"


def check_semantic_log_path(path: str, create: bool = False) -> None:
    name = "semantic_log_path"
    if path.endswith(os.sep) or os.path.isdir(path):
        raise SettingError(f"{name} {path!r} is a directory; it must name a log file")
    for p in [path] + [f"{path}.{i}" for i in range(1, LOG_BACKUPS + 1)]:
        if not os.path.lexists(p):
            continue
        ours, why = _log_is_ours(p)
        if not ours:
            raise SettingError(f"{name}: {p} already exists and is not a simllm_ros decision log ({why}); "
                               "the node would append to it or overwrite it when rotating. Choose another file")
    folder = os.path.dirname(os.path.abspath(path))
    _writable_dir(name, folder, "the log folder")
    if create:
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
            finally:
                os.close(fd)
        except OSError as e:
            raise SettingError(f"{name} {path!r}: cannot write the log: {describe_error(e)}") from None


def check_warmup_queries(path: str) -> None:
    name = "warmup_queries"
    st = _stat(name, path)
    if st is None:
        raise SettingError(f"{name} {path!r}: no such file")
    if not stat.S_ISREG(st.st_mode):
        try:
            os.close(open_regular(path))
        except OSError as e:
            raise SettingError(f"{name} {path!r}: {describe_error(e)}; it must be a JSON Lines file") from None
    if st.st_size > MAX_WARMUP_BYTES:
        raise SettingError(f"{name} {path!r} is {st.st_size} bytes; at most {MAX_WARMUP_BYTES} are read")
    if not os.access(path, os.R_OK):
        raise SettingError(f"{name} {path!r} is not readable by this process")


def check_thermal_root(path: str) -> None:
    name = "thermal_root"
    st = _stat(name, path)
    if st is None:
        if path == SPEC_BY_NAME[name].default:
            return  # no thermal zones on this machine: reported as "no thermal data"
        raise SettingError(f"{name} {path!r}: no such directory")
    if not stat.S_ISDIR(st.st_mode):
        raise SettingError(f"{name} {path!r} is not a directory (expected a sysfs thermal folder such as "
                           "/sys/class/thermal)")


def check(name: str, value, create: bool = False) -> None:
    """Raise SettingError when a path parameter cannot work; other parameters and "" always pass."""
    if name not in PATH_PARAMS or not isinstance(value, str) or value == "":
        return
    if "\0" in value:
        raise SettingError(f"{name} contains a NUL character")
    if name == "persist_path":
        check_persist_path(value, create)
    elif name == "semantic_log_path":
        check_semantic_log_path(value, create)
    elif name == "warmup_queries":
        if not value.strip().isdigit():  # a number N: the N most-used tasks of the semantic log
            check_warmup_queries(value)
    else:
        check_thermal_root(value)


def check_all(values, create: bool = False) -> None:
    """Every path parameter of a Settings (or dict of values)."""
    get = values.get if isinstance(values, dict) else (lambda k: getattr(values, k))
    for name in PATH_PARAMS:
        check(name, get(name), create)
