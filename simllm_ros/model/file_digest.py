"""A model file's content digest: SHA-256 over every byte of the file (64 MiB segments hashed on several threads),
remembered with the file's identity (device, inode, size, mtime and ctime in ns) in a small JSON record in the cache
folder, so that a later load of an unchanged file does not read it again.

Why the whole file: the copies made from a GGUF (its conversion, its checked rows, its packed blocks, its load checks)
are keyed by this digest. A key on the name, size and first MiB took two fine-tunes saved under one default name
for the same file (their first MiB is all metadata) and ran the first's weights for the second. Hashing reads the
file once (fast on a core with SHA extensions, x86's SHA-NI or Arm's crypto extensions; the segments
share the cores), into the page cache the load then reads from; a changed file has another size,
mtime or ctime (a write or a replacement sets them; ctime cannot be set back by a user), or another inode.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..safe_io import open_regular
from .cache_records import read_records, update_record

DIGESTS_FILE = "file_digests.json"
KEEP_RECORDS = 256  # files remembered in the record (the newest)
_CHUNK = 8 << 20
SEGMENT = 64 << 20
THREADS = 4

_MEMO: dict[tuple, str] = {}  # this process's digests by file identity (the record may be unwritable)
_LOCK = threading.Lock()


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _segment(fd: int, start: int, stop: int) -> bytes:
    h = hashlib.sha256()
    buf = bytearray(min(_CHUNK, max(stop - start, 1)))
    view = memoryview(buf)
    while start < stop:
        n = os.preadv(fd, [view[:min(len(buf), stop - start)]], start)
        if n <= 0:
            raise OSError(f"file ended at byte {start}, before its size {stop} when it was opened")
        h.update(view[:n])  # hashlib lets go of the GIL on large buffers: the segments hash in parallel
        start += n
    return h.digest()


def whole_digest(fd: int) -> str:
    """SHA-256 of the SHA-256s of an open file's SEGMENT-byte segments (and its size): every byte, read in chunks
    (no more than _CHUNK a thread in memory), the segments on up to THREADS threads."""
    size = os.fstat(fd).st_size
    bounds = [(s, min(size, s + SEGMENT)) for s in range(0, size, SEGMENT)] or [(0, 0)]
    threads = max(1, min(THREADS, len(bounds), os.cpu_count() or 1))
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(lambda b: _segment(fd, *b), bounds))
    h = hashlib.sha256(f"sha256-segments {SEGMENT} {size}\n".encode())
    for p in parts:
        h.update(p)
    return h.hexdigest()


def content_digest(path: str, record_dir: str | None = None) -> str:
    """The digest of file `path`'s content: taken from this process's memo or the record in `record_dir` where the
    file's identity is the one it was hashed at, else hashed now and recorded (a record that cannot be written
    costs a rehash at the next process, nothing else). OSError for a file that cannot be read (NotRegularFile:
    a directory, a FIFO)."""
    path = os.path.abspath(path)
    fd = open_regular(path)
    try:
        before = _identity(os.fstat(fd))
        if before in _MEMO:
            return _MEMO[before]
        store = os.path.join(record_dir, DIGESTS_FILE) if record_dir else None
        kept = read_records(store).get(path) if store else None
        if isinstance(kept, dict) and kept.get("identity") == list(before) and isinstance(kept.get("sha256"), str):
            _MEMO[before] = kept["sha256"]
            return kept["sha256"]
        digest = whole_digest(fd)
        if _identity(os.fstat(fd)) != before:  # written while it was read: this digest is of no one content
            raise OSError(f"'{path}' changed while it was read; load it again once it is written")
    finally:
        os.close(fd)
    _MEMO[before] = digest
    if store:
        with _LOCK:
            try:
                update_record(store, path, {"identity": list(before), "sha256": digest}, keep=KEEP_RECORDS)
            except OSError:
                pass
    return digest
