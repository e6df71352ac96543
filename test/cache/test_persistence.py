"""Pool snapshots: round trip through real engines, and every kind of bad file is reported, never fatal.

Also: kill -9 during save never leaves a broken snapshot, and a pickle named like the snapshot runs nothing.
"""
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hostile_snapshots
from core_fixtures import BASE, BULLETIN, clinc_by_intent
from simllm_ros.cache import error_bound, persistence
from simllm_ros.cache.block_store import KVShape
from simllm_ros.serving.engine import Engine
from simllm_ros.cache.kv_pool import KVPool
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.settings import Settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PERSIST = dict(BASE, cache_size="128MB")


def load_engine(folder, **overrides):
    e = Engine(Settings.from_overrides(**{**PERSIST, "persist_path": str(folder), **overrides}))
    e.load()  # must never raise for a bad snapshot
    return e


def entry_records(pool):
    out = {}
    for e in pool.describe_entries():
        k, v = pool.entry_kv(e.key)
        out[(e.scope, tuple(e.tokens))] = dict(question=e.question, answer=e.answer, digest=e.context_digest,
                                                hits=e.hits, created=e.created, last_used=e.last_used,
                                                k=k.clone(), v=v.clone(), fp=e.fingerprint.copy())
    return out


def questions():
    by = clinc_by_intent(limit_per_intent=1)
    return [by["weather"][0], by["traffic"][0], by["gas"][0]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A snapshot written by a real engine after a few requests (two scopes), and what it held."""
    folder = tmp_path_factory.mktemp("snap")
    e = load_engine(folder)
    assert e.load_report["snapshot"].startswith("no snapshot")
    answers = {}
    for i, q in enumerate(questions()):
        r = e.handle(QueryRequest(prompt=q, context=BULLETIN, cache_scope="robot" if i else "", max_new_tokens=8))
        assert r.success and r.cache_result in (CacheResult.MISS, CacheResult.EXACT_PREFIX)
        answers[q] = (r.answer, "robot" if i else "")
    e.handle(QueryRequest(prompt=questions()[1], context=BULLETIN, cache_scope="robot", max_new_tokens=8))  # a hit
    records = entry_records(e.pool)
    path = e.save()
    assert path == persistence.snapshot_path(str(folder)) and os.path.isfile(path)
    assert not [f for f in os.listdir(folder) if f not in (persistence.FILENAME, error_bound.FILE_NAME)], \
        "temp files left after a clean save"
    e.unload()
    return folder, records, answers


def test_round_trip(saved, tmp_path):
    folder, records, answers = saved
    shutil.copy(persistence.snapshot_path(str(folder)), tmp_path / persistence.FILENAME)
    e = load_engine(tmp_path)
    try:
        assert e.load_report["snapshot"] == "loaded" and e.load_report["restored"] == len(records) == 3
        e.pool.check_consistency()
        got = entry_records(e.pool)
        assert set(got) == set(records)
        for key, want in records.items():
            have = got[key]
            for f in ("question", "answer", "digest", "hits", "created", "last_used"):
                assert have[f] == want[f], (f, have[f], want[f])
            assert torch.equal(have["k"], want["k"]) and torch.equal(have["v"], want["v"])
            assert np.array_equal(have["fp"], want["fp"])
        # A repeated request is served from the restored pool at once, with the same answer (float32: lossless).
        q = questions()[2]
        answer, scope = answers[q]
        r = e.handle(QueryRequest(prompt=q, context=BULLETIN, cache_scope=scope, max_new_tokens=8))
        assert r.cache_result == CacheResult.EXACT_PREFIX and r.reused_tokens == r.prompt_tokens - 1
        assert r.answer == answer
        e.apply_settings({"enable_answer_cache": True, "answer_max_age_s": 1e6, "answer_memo": False})
        r = e.handle(QueryRequest(prompt=q, context=BULLETIN, cache_scope=scope, max_new_tokens=8))
        assert r.cache_result == CacheResult.ANSWER and r.answer == answer
        # Scopes survive the round trip: the default-scope entry is not visible from "robot".
        q0 = questions()[0]
        r = e.handle(QueryRequest(prompt=q0, context=BULLETIN, cache_scope="elsewhere", max_new_tokens=2))
        assert r.cache_result == CacheResult.MISS and r.similarity == 0.0
    finally:
        e.unload()


# --------------------------------------------------------------------------- bad snapshots
def _rewrite(path, mutate_manifest=None, mutate_tensors=None, fix_checksum=True):
    """Edit a snapshot; by default with a valid checksum, as a buggy writer would leave it, so that the
    structural checks behind the checksum are exercised."""
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    manifest = json.loads(meta["manifest"])
    tensors = load_file(path)
    if mutate_manifest:
        mutate_manifest(manifest)
    if mutate_tensors:
        mutate_tensors(tensors)
    text = json.dumps(manifest)
    os.unlink(path)
    save_file(tensors, path, metadata={"manifest": text,
                                       "sha256": persistence.checksum(text, tensors) if fix_checksum else meta["sha256"]})


def truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * 0.6))


def flip_middle(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = bytearray(f.read(256))
        f.seek(size // 2)
        f.write(bytes(b ^ 0x5A for b in chunk))


def garbage(path):
    with open(path, "wb") as f:
        f.write(random.Random(7).randbytes(200_000))


def rows_too_few(path):
    def m(man):
        man["entries"][0]["rows"] = man["entries"][0]["rows"][:-1]
    _rewrite(path, m)


def rows_out_of_range(path):
    def m(man):
        man["entries"][1]["rows"][-1] = 10_000
    _rewrite(path, m)


def rows_negative(path):
    def m(man):
        man["entries"][2]["rows"][0] = -1
    _rewrite(path, m)


def tokens_not_ints(path):
    def m(man):
        man["entries"][0]["tokens"][3] = "hello"
    _rewrite(path, m)


def token_edited_without_checksum(path):
    def m(man):
        man["entries"][0]["tokens"][5] += 1  # still valid JSON and a valid token: only the checksum tells
    _rewrite(path, m, fix_checksum=False)


def manifest_not_json(path):
    tensors = load_file(path)
    os.unlink(path)
    save_file(tensors, path, metadata={"manifest": "{not json"})


def kv_tensor_wrong_shape(path):
    def t(ts):
        ts["k"] = ts["k"][:, :, :, :8].contiguous()
    _rewrite(path, mutate_tensors=t)


def fingerprints_missing(path):
    def t(ts):
        del ts["fingerprints"]
    _rewrite(path, mutate_tensors=t)


DAMAGES = [
    (truncate, ("unreadable",)),
    (flip_middle, ("checksum",)),
    (garbage, ("unreadable",)),
    (rows_too_few, ("inconsistent",)),
    (rows_out_of_range, ("inconsistent",)),
    (rows_negative, ("inconsistent",)),
    (tokens_not_ints, ("inconsistent",)),
    (token_edited_without_checksum, ("checksum",)),
    (manifest_not_json, ("unreadable",)),
    (kv_tensor_wrong_shape, ("inconsistent",)),
    (fingerprints_missing, ("inconsistent",)),
]
ENGINE_LEVEL = ("truncate", "flip_middle", "garbage", "rows_out_of_range", "kv_tensor_wrong_shape")


def _damaged_copy(saved, tmp_path, damage):
    folder = saved[0]
    path = tmp_path / persistence.FILENAME
    shutil.copy(persistence.snapshot_path(str(folder)), path)
    damage(str(path))
    return path


@pytest.mark.parametrize("damage, reason_words", DAMAGES, ids=[d.__name__ for d, _ in DAMAGES])
def test_bad_snapshot_rejected_by_load(saved, tmp_path, damage, reason_words):
    """Every kind of damage, straight through persistence.load into a pool like the engine's."""
    folder = saved[0]
    with safe_open(persistence.snapshot_path(str(folder)), framework="pt") as f:
        ident = json.loads(f.metadata()["manifest"])["identity"]  # the good file's: test_round_trip loads it
    _damaged_copy(saved, tmp_path, damage)
    shape = KVShape(**ident["model"]["kv_shape"])
    pool = KVPool(shape, block_tokens=ident["block_tokens"], budget_bytes=128 * 10**6, kv_bits=ident["kv_bits"],
                  model_dtype=torch.float32, fingerprint_dim=384)
    with pytest.raises(persistence.SnapshotSkipped) as exc:
        persistence.load(pool, str(tmp_path), ident)
    reason = str(exc.value)
    print(f"\n{damage.__name__}: {reason[reason.index('kv_pool.safetensors') + 19:][:150]}")
    assert any(w in reason for w in reason_words), reason
    assert len(pool) == 0 and pool.bytes_used == 0 and pool.stats().blocks_used == 0
    pool.check_consistency()


@pytest.mark.parametrize("damage, reason_words", [d for d in DAMAGES if d[0].__name__ in ENGINE_LEVEL],
                         ids=list(ENGINE_LEVEL))
def test_bad_snapshot_engine_starts_empty(saved, tmp_path, damage, reason_words):
    """The engine reports the reason in load_report, starts empty and consistent, serves, and saves anew."""
    _damaged_copy(saved, tmp_path, damage)
    e = load_engine(tmp_path)
    try:
        report = e.load_report["snapshot"]
        assert report and report != "loaded" and any(w in report for w in reason_words), report
        assert e.load_report["restored"] == 0
        assert len(e.pool) == 0 and e.pool.bytes_used == 0
        e.pool.check_consistency()
        r = e.handle(QueryRequest(prompt="Is Elm Street open?", context=BULLETIN, max_new_tokens=2))
        assert r.success and r.cache_result == CacheResult.MISS
        e.save()
        ident, pool = e.warm_start.identity(), e.pool
        again = pool.empty_like()
    finally:
        e.unload()
    assert persistence.load(again, str(tmp_path), ident) == 1


def test_snapshot_from_other_setup_is_reported(saved, tmp_path):
    """A snapshot saved with kv_bits=8 is not loaded by a kv_bits=32 engine (and vice versa)."""
    e8 = load_engine(tmp_path, kv_bits=8)
    try:
        assert e8.handle(QueryRequest(prompt=questions()[0], context=BULLETIN, max_new_tokens=2)).success
        e8.save()
        ident8, pool8 = e8.warm_start.identity(), e8.pool
        # 8-bit snapshots carry scales: a NaN or infinite scale would dequantize to NaN KV, so it is refused.
        for name, value in (("k_scale", float("nan")), ("v_zero", float("inf"))):
            bad = tmp_path / f"bad_{name}"
            bad.mkdir()
            manifest, tensors = hostile_snapshots.read_good(persistence.snapshot_path(str(tmp_path)))
            tensors[name].view(-1)[7] = value
            hostile_snapshots.write_snapshot(persistence.snapshot_path(str(bad)), json.dumps(manifest), tensors)
            pool8.clear()
            with pytest.raises(persistence.SnapshotSkipped, match=f"tensor '{name}' holds non-finite values"):
                persistence.load(pool8, str(bad), ident8)
            assert len(pool8) == 0
        assert persistence.load(pool8, str(tmp_path), ident8) == 1  # control: the unedited one loads
    finally:
        e8.unload()
    e = load_engine(tmp_path)
    try:
        report = e.load_report["snapshot"]
        print(f"\nother setup: {report}")
        assert "another setup" in report and "kv_bits" in report
        assert len(e.pool) == 0
        e.pool.check_consistency()
    finally:
        e.unload()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_pickle_payload_is_not_executed(tmp_path):
    marker = tmp_path / "marker_from_snapshot"
    payload = pickle.dumps(_Payload(str(marker)))
    # Control: the payload really runs when unpickled (else the test below could not fail).
    control = tmp_path / "marker_control"
    pickle.loads(pickle.dumps(_Payload(str(control))))
    assert control.exists()
    (tmp_path / persistence.FILENAME).write_bytes(payload)
    e = load_engine(tmp_path)
    try:
        assert not marker.exists()
        assert "unreadable" in e.load_report["snapshot"]
        assert len(e.pool) == 0
        e.pool.check_consistency()
    finally:
        e.unload()
    # The torch.save flavour of a pickle (a zip holding data.pkl) fares the same.
    torch.save({"x": _Payload(str(marker))}, tmp_path / persistence.FILENAME)
    pool = KVPool(KVShape(2, 2, 8), block_tokens=4, budget_bytes=2**20, kv_bits=32,
                  model_dtype=torch.float32, fingerprint_dim=8)
    with pytest.raises(persistence.SnapshotSkipped):
        persistence.load(pool, str(tmp_path), {"any": "identity"})
    assert not marker.exists()


# --------------------------------------------------------------------------- kill -9 during save
SAVER = textwrap.dedent("""
    import sys, time
    import numpy as np, torch
    sys.path.insert(0, sys.argv[3])
    from simllm_ros.cache import persistence
    from simllm_ros.cache.block_store import KVShape
    from simllm_ros.cache.kv_pool import KVPool
    folder, gen = sys.argv[1], int(sys.argv[2])
    pool = KVPool(KVShape(30, 3, 64), block_tokens=16, budget_bytes=160 * 2**20, kv_bits=32,
                  model_dtype=torch.float32, fingerprint_dim=8)
    IDENT = {"format": "test", "model": "kill9"}
    N, LEN = 10, 240  # 10 entries x 15 blocks x 737 KB: a ~110 MB snapshot
    fp = np.ones(8, np.float32) / np.sqrt(8)
    while True:
        for i in range(N):
            k = torch.full((30, 3, LEN, 64), float(i))
            pool.insert(scope="s", tokens=[i] * LEN, k=k, v=-k, fingerprint=fp, question=f"q{i}",
                        context_digest="0" * 32, answer=f"gen{gen}", now=float(gen))
        t0 = time.monotonic()
        persistence.save(pool, folder, IDENT)
        print(f"saved {gen} {time.monotonic() - t0:.3f}", flush=True)
        gen += 1
""")


def _check_snapshot(folder):
    pool = KVPool(KVShape(30, 3, 64), block_tokens=16, budget_bytes=160 * 2**20, kv_bits=32,
                  model_dtype=torch.float32, fingerprint_dim=8)
    n = persistence.load(pool, str(folder), {"format": "test", "model": "kill9"})
    assert n == 10
    gens = {e.answer for e in pool.describe_entries()}
    assert len(gens) == 1, f"snapshot mixes generations {gens}"
    for e in pool.describe_entries():
        k, v = pool.entry_kv(e.key)
        i = e.tokens[0]
        assert float(k.min()) == float(k.max()) == i and float(v.min()) == -i
    pool.check_consistency()
    return int(gens.pop()[3:])


def test_kill9_during_save_keeps_a_loadable_snapshot(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    folder = tmp_path / "snap"
    rng = random.Random(1234)
    loaded_gens, kills_mid_save, seen = [], 0, set()
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, str(script), str(folder), str(1000 * (trial + 1)), REPO],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()
            assert first.startswith("saved"), (first, proc.stderr.read() if proc.poll() is not None else "")
            save_s = float(first.split()[2])
            time.sleep(rng.uniform(0.0, 1.5 * save_s))  # lands inside a later save most of the time
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        printed = [int(line.split()[1]) for line in ([first] + out.splitlines()) if line.startswith("saved")]
        partial = folder / persistence.PARTIAL_DIR
        temps = sorted(os.listdir(partial)) if partial.is_dir() else []
        assert set(os.listdir(folder)) <= {persistence.FILENAME, persistence.PARTIAL_DIR}, os.listdir(folder)
        kills_mid_save += bool(temps)
        seen |= set(temps)
        gen = _check_snapshot(folder)  # loads, whole, one generation
        assert not partial.is_dir() or not os.listdir(partial), "load must clear what a killed save left"
        # the snapshot is the last save that finished (its print may not have happened before the kill)
        assert gen in (printed[-1], printed[-1] + 1), (gen, printed)
        loaded_gens.append(gen)
    print(f"\nkill -9 trials: loaded generations {loaded_gens}; kills that left a temp file: {kills_mid_save}/6; "
          f"temp files left: {sorted(seen)}")
    assert kills_mid_save >= 1, "no kill landed inside a save: the test did not exercise the case"


# --------------------------------------------------------------------------- hostile snapshots, engine level

_hostile_times: dict[str, float] = {}


@pytest.fixture(scope="module")
def restoring_engine(saved):
    """One engine with the snapshot's identity; each variant runs engine.restore(), the code configure runs."""
    e = load_engine(saved[0])
    assert e.load_report["restored"] == 3  # control: the real snapshot loads
    yield e
    e.unload()
    if _hostile_times:
        worst = max(_hostile_times, key=_hostile_times.get)
        print(f"\nhostile snapshots: {len(_hostile_times)} variants, restore time max "
              f"{_hostile_times[worst] * 1000:.0f} ms ({worst}), total {sum(_hostile_times.values()):.1f} s")


def _restore_with_timeout(engine, folder, timeout=20.0):
    engine.settings = engine.settings.replace(persist_path=str(folder))
    engine.pool.clear()
    out = {}

    def run():
        t0 = time.monotonic()
        try:
            out["n"] = engine.restore()
        except BaseException as e:  # restore must never raise; recorded so the test says so
            out["raised"] = e
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"restore hung for more than {timeout} s"
    assert "raised" not in out, f"restore raised {out.get('raised')!r}"
    return out["n"], out["s"]


@pytest.mark.parametrize("name, make", hostile_snapshots.VARIANTS, ids=[n for n, _ in hostile_snapshots.VARIANTS])
def test_hostile_snapshot_engine_starts_empty(restoring_engine, saved, tmp_path, name, make):
    """Each variant: restore returns at once, logs a reason naming the file, and leaves an empty, consistent pool."""
    e = restoring_engine
    good = persistence.snapshot_path(str(saved[0]))
    make(tmp_path, good)
    n, secs = _restore_with_timeout(e, tmp_path)
    _hostile_times[name] = secs
    report = e.load_report["snapshot"]
    assert n == 0 and e.load_report["restored"] == 0, report
    assert report != "loaded" and persistence.snapshot_path(str(tmp_path)) in report, report
    assert len(e.pool) == 0 and e.pool.bytes_used == 0
    e.pool.check_consistency()
    assert secs < 10, f"restore took {secs:.1f} s"


@pytest.mark.parametrize("name, make", hostile_snapshots.HARMLESS, ids=[n for n, _ in hostile_snapshots.HARMLESS])
def test_odd_but_harmless_snapshot_loads(restoring_engine, saved, tmp_path, name, make):
    e = restoring_engine
    make(tmp_path, persistence.snapshot_path(str(saved[0])))
    n, _ = _restore_with_timeout(e, tmp_path)
    assert n == 3 and e.load_report["snapshot"] == "loaded", e.load_report
    victim = tmp_path / "victim" / "precious.txt"
    if name == "partial_is_symlink":
        assert victim.read_text() == "keep me", "load deleted a file through a planted .partial symlink"
        e.save()  # a save replaces the planted link with our own folder, and writes nothing into the victim
        assert os.listdir(tmp_path / "victim") == ["precious.txt"]
        assert not os.path.islink(tmp_path / persistence.PARTIAL_DIR)


def test_snapshot_from_another_arithmetic_is_not_loaded(restoring_engine, saved, tmp_path):
    """KV saved by a process whose model arithmetic differs (another CPU or kernel choice: on an AMX box,
    oneDNN allowed AMX changed the bits of the same 4-bit model) is not what this process computes, so an
    exact-prefix hit on it would change answers silently: the snapshot carries the saving process's
    numerics digest, and a process with another one starts empty, saying why."""
    e = restoring_engine
    good = persistence.snapshot_path(str(saved[0]))
    manifest, _ = hostile_snapshots.read_good(good)
    assert manifest["identity"]["numerics"] == e.backend.numerics and len(e.backend.numerics) == 16
    hostile_snapshots.foreign_identity("numerics", "0123456789abcdef")(tmp_path, good)
    n, _ = _restore_with_timeout(e, tmp_path)
    report = e.load_report["snapshot"]
    assert n == 0 and "another setup (differs in: numerics)" in report and "other bits" in report, report
    assert len(e.pool) == 0
    e.pool.check_consistency()


def test_hostile_engine_still_serves(restoring_engine):
    """After every variant, the same engine answers and pools a request."""
    e = restoring_engine
    e.pool.clear()
    r = e.handle(QueryRequest(prompt="Is Elm Street open?", context=BULLETIN, max_new_tokens=2))
    assert r.success and len(e.pool) == 1
    e.pool.check_consistency()


def test_future_timestamps_are_clamped_to_now(restoring_engine, saved, tmp_path):
    """A robot whose clock restarted at 1970 sees every saved time in the future: the snapshot still loads,
    with those times set to now (a negative age would otherwise inflate recency scores)."""
    e = restoring_engine
    make = hostile_snapshots.edit(lambda m: [en.update(created=4e9, last_used=4e9) for en in m["entries"]])
    make(tmp_path, persistence.snapshot_path(str(saved[0])))
    before = time.time()
    n, _ = _restore_with_timeout(e, tmp_path)
    assert n == 3, e.load_report
    for en in e.pool.describe_entries():
        assert before - 1 <= en.created <= time.time() and before - 1 <= en.last_used <= time.time()
