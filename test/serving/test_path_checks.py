"""Path parameters that cannot work are refused with a reason naming the parameter: on set and at configure.

Real files, folders and FIFOs in tmp_path; no mocks. (Through the real node: test_reliability_hostile.py.)
"""
import json
import os
import time

import pytest

from simllm_ros import path_checks
from simllm_ros.settings import SettingError


NOT_BLOCKED_S = 5.0  # opening a FIFO would block forever; this leaves room for pauses of a shared machine


def refused(name, value, create=False):
    with pytest.raises(SettingError) as exc:
        path_checks.check(name, value, create)
    msg = str(exc.value)
    assert name in msg, msg
    return msg


def test_empty_values_mean_off():
    for name in path_checks.PATH_PARAMS:
        path_checks.check(name, "", create=True)


# ------------------------------------------------------------------------------------- persist_path
def test_persist_path_created_and_probed(tmp_path):
    p = tmp_path / "a" / "b" / "pool"
    path_checks.check("persist_path", str(p))  # on set: nothing is created
    assert not p.exists()
    path_checks.check("persist_path", str(p), create=True)  # at configure: created and written once
    assert p.is_dir() and os.listdir(p / ".partial") == []


@pytest.mark.parametrize("why", ["root", "home_like", "regular_file", "file_in_the_way", "snapshot_is_dir",
                                 "under_proc", "nul"])
def test_persist_path_refused(tmp_path, why):
    if why == "root":
        msg = refused("persist_path", "/")
        assert "a folder of its own" in msg
    elif why == "home_like":
        (tmp_path / ".bashrc").write_text("x")
        (tmp_path / "Documents").mkdir()
        assert "2 entries" in refused("persist_path", str(tmp_path))
    elif why == "regular_file":
        f = tmp_path / "pool"
        f.write_text("not a folder")
        assert "not a directory" in refused("persist_path", str(f))
    elif why == "file_in_the_way":
        (tmp_path / "x").write_text("")
        assert "not a directory" in refused("persist_path", str(tmp_path / "x" / "pool")).lower()
    elif why == "snapshot_is_dir":
        (tmp_path / "kv_pool.safetensors").mkdir()
        assert "is a directory" in refused("persist_path", str(tmp_path))
    elif why == "under_proc":  # a filesystem that refuses new files even to root
        refused("persist_path", "/proc/simllm_pool", create=True)
    else:
        refused("persist_path", "/tmp/a\0b")


def test_persist_path_with_our_files_and_junk_is_accepted(tmp_path):
    """A folder that already holds a snapshot (even a hostile one) is ours: the load decides about it."""
    (tmp_path / "kv_pool.safetensors").write_bytes(b"garbage")
    (tmp_path / "junk").write_text("x")
    path_checks.check("persist_path", str(tmp_path), create=True)


# ------------------------------------------------------------------------------- semantic_log_path
def test_semantic_log_absent_empty_or_ours(tmp_path):
    log = tmp_path / "logs" / "decisions.jsonl"
    path_checks.check("semantic_log_path", str(log), create=True)
    assert log.exists() and log.read_text() == ""
    path_checks.check("semantic_log_path", str(log))  # empty: fine
    log.write_text(json.dumps({"time": time.time(), "request_id": "a", "tier": "MISS"}) + "\n")
    path_checks.check("semantic_log_path", str(log), create=True)


@pytest.mark.parametrize("why", ["foreign_file", "foreign_json", "foreign_backup", "fifo", "directory", "dev_null"])
def test_semantic_log_refused(tmp_path, why):
    log = tmp_path / "decisions.jsonl"
    if why == "foreign_file":
        log.write_text("root:x:0:0:root:/root:/bin/bash\n")
    elif why == "foreign_json":
        log.write_text('{"user": "alice"}\n')
    elif why == "foreign_backup":  # rotation would overwrite decisions.jsonl.2
        log.write_text("")
        (tmp_path / "decisions.jsonl.2").write_text("precious\n")
    elif why == "fifo":  # appending would block forever
        os.mkfifo(log)
    elif why == "directory":
        log.mkdir()
    else:
        os.symlink("/dev/null", log)
    t0 = time.monotonic()
    msg = refused("semantic_log_path", str(log), create=True)
    assert time.monotonic() - t0 < NOT_BLOCKED_S
    if why == "foreign_backup":
        assert "decisions.jsonl.2" in msg and (tmp_path / "decisions.jsonl.2").read_text() == "precious\n"


# -------------------------------------------------------------------------- warmup_queries, thermal_root
def test_warmup_queries(tmp_path):
    good = tmp_path / "warm.jsonl"
    good.write_text('{"prompt": "hello"}\n')
    path_checks.check("warmup_queries", str(good))
    assert "no such file" in refused("warmup_queries", str(tmp_path / "missing.jsonl"))
    os.mkfifo(tmp_path / "fifo.jsonl")
    t0 = time.monotonic()
    assert "FIFO" in refused("warmup_queries", str(tmp_path / "fifo.jsonl"))
    assert time.monotonic() - t0 < NOT_BLOCKED_S
    assert "directory" in refused("warmup_queries", str(tmp_path))


def test_thermal_root(tmp_path):
    path_checks.check("thermal_root", str(tmp_path))
    path_checks.check("thermal_root", "/sys/class/thermal")  # the default may be absent (no zones)
    assert "no such directory" in refused("thermal_root", str(tmp_path / "nope"))
    (tmp_path / "f").write_text("")
    assert "not a directory" in refused("thermal_root", str(tmp_path / "f"))
