"""Opening files that someone else may have tampered with, without ever blocking on them.

Why it exists: the node reads files it does not fully control (a pool snapshot, sysfs
temperatures, a warm-up file, an existing log). A FIFO in their place would block a plain
open() forever, a symlink loop raises odd errors, a device may have side effects on open.
Every such read goes through `open_regular`: the path is stat-ed first (a non-regular file
is refused without being opened), then opened with O_NONBLOCK | O_NOCTTY, and fstat-ed
again (it may have been swapped in between). Only a regular file is ever read. Small JSON files the node keeps
are written with `write_json` (a temporary file beside it, flushed, then renamed over it): a reader sees the old
file or the new one, never half of one.
"""
from __future__ import annotations

import errno
import json
import os
import stat


class NotRegularFile(OSError):
    """The path exists but is not a regular file (FIFO, socket, device, directory)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def describe_error(e: OSError) -> str:
    """A short reason for the log: 'a FIFO', 'symlink loop', 'No such file or directory'."""
    if isinstance(e, NotRegularFile):
        return e.strerror or "not a regular file"
    if e.errno == errno.ELOOP:
        return "symlink loop (or too many levels of symbolic links)"
    return e.strerror or type(e).__name__


def open_regular(path: str) -> int:
    """An O_RDONLY fd of a regular file; raises NotRegularFile or OSError, never blocks on open."""
    st = os.stat(path)  # follows symlinks; a loop raises ELOOP
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, f"{_kind(st.st_mode)}, not a regular file", path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between stat and open
            raise NotRegularFile(errno.EINVAL, f"{_kind(st.st_mode)}, not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Exactly n bytes at offset, or OSError (a file that shrank while being read)."""
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, min(n - len(out), 1 << 24), offset + len(out))
        if not chunk:
            raise OSError(errno.EIO, f"file ended after {offset + len(out)} bytes, expected {offset + n}")
        out += chunk
    return bytes(out)


def read_regular(path: str, max_bytes: int) -> bytes:
    """The whole content of a regular file of at most max_bytes; raises OSError (NotRegularFile included)
    or ValueError when it is larger. sysfs files report size 4096 whatever they hold, so the size check
    reads up to max_bytes + 1 instead of trusting st_size."""
    fd = open_regular(path)
    try:
        data = b""
        while len(data) <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes")
    return data


def write_json(path: str, data, **dump_args) -> None:
    """`data` as JSON at `path`, atomically (written beside it, fsync-ed, renamed over it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, **dump_args)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
