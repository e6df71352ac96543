"""compute_threads: while the model runs, torch has one thread and our kernels the cores it had; everything is
as before afterwards, other threads keep their own count, and answers do not change with it."""
from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from simllm_ros.kernels import compute_threads
from simllm_ros.request import QueryRequest


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_kernels_get_torchs_cores_for_the_while(two_threads):
    assert compute_threads.kernel_threads() == 2
    with compute_threads.kernels_own_cores():
        assert torch.get_num_threads() == 1 and compute_threads.kernel_threads() == 2
        with compute_threads.kernels_own_cores():  # nested: the outer one holds them
            assert torch.get_num_threads() == 1 and compute_threads.kernel_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2 and compute_threads.kernel_threads() == 2
    with pytest.raises(RuntimeError):
        with compute_threads.kernels_own_cores():
            raise RuntimeError("a fault inside a model turn")
    assert torch.get_num_threads() == 2 and compute_threads.kernel_threads() == 2  # restored all the same


def test_nothing_changes_where_the_kernels_do_not_do_the_work_or_it_is_off(two_threads, monkeypatch):
    with compute_threads.kernels_own_cores(active=False):
        assert torch.get_num_threads() == 2
    monkeypatch.setattr(compute_threads, "ENABLED", False)
    with compute_threads.kernels_own_cores():
        assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    with compute_threads.kernels_own_cores():
        assert torch.get_num_threads() == 1 and compute_threads.kernel_threads() == 1


def test_a_thread_with_its_own_count_keeps_it_while_a_model_turn_runs(two_threads):
    """torch.set_num_threads also sets what a thread starts with: the fingerprinter's threads set their own."""
    with compute_threads.kernels_own_cores():
        with concurrent.futures.ThreadPoolExecutor(1) as plain:
            assert plain.submit(torch.get_num_threads).result() == 1  # what own_count is there for
        with concurrent.futures.ThreadPoolExecutor(1, initializer=compute_threads.own_count(2)) as own:
            assert own.submit(torch.get_num_threads).result() == 2
        assert torch.get_num_threads() == 1  # the model's thread keeps its one


def test_an_engine_gives_its_kernels_the_cores_and_answers_the_same(two_threads, monkeypatch):
    from core_fixtures import BULLETIN, LOSSLESS, shared_engine

    e = shared_engine(**LOSSLESS)
    if not e.backend.kernels_do_the_work:
        pytest.skip("the runner's products are torch's here")
    seen = []
    real = compute_threads.kernel_threads

    def watch():
        n = real()
        seen.append((n, torch.get_num_threads()))
        return n
    monkeypatch.setattr(compute_threads, "kernel_threads", watch)

    def ask(scope):
        return e.handle(QueryRequest(prompt="Which road is closed this week?", context=BULLETIN, cache_scope=scope,
                                     max_new_tokens=12))
    a = ask("threads-kernels")
    assert seen and all(s == (2, 1) for s in seen)  # every product and attention pass: 2 workers, torch one
    assert torch.get_num_threads() == 2
    assert e.fingerprinter.embed_async(["a text never embedded before, on the fingerprinter's thread"]).result().shape
    assert e.fingerprinter._workers.submit(torch.get_num_threads).result() == e.fingerprinter._threads
    monkeypatch.setattr(compute_threads, "ENABLED", False)
    seen.clear()
    b = ask("threads-torch")
    assert seen and all(s == (2, 2) for s in seen)
    assert a.success and b.success and a.answer == b.answer and a.generated_tokens == b.generated_tokens


def test_work_done_while_another_thread_computes_keeps_to_one_thread(two_threads):
    """kernels_alone: the engine's early pass, run while the fingerprinter's threads compute, leaves them the other
    cores; the turn's count comes back after it, also after a fault."""
    with compute_threads.kernels_own_cores():
        with compute_threads.kernels_alone():
            assert compute_threads.kernel_threads() == 1 and torch.get_num_threads() == 1
        assert compute_threads.kernel_threads() == 2
        with pytest.raises(RuntimeError):
            with compute_threads.kernels_alone():
                raise RuntimeError("a fault in the early pass")
        assert compute_threads.kernel_threads() == 2
    with compute_threads.kernels_alone():  # outside a model turn as well
        assert compute_threads.kernel_threads() == 1
    assert compute_threads.kernel_threads() == 2 and torch.get_num_threads() == 2


def test_the_engine_runs_its_early_pass_on_one_thread_while_the_fingerprint_computes(two_threads, monkeypatch):
    """A SEMANTIC hit on a new question at 2 threads: the early pass run ahead uses one kernel worker, the rest of
    the request two (the fingerprinter keeps its threads meanwhile)."""
    from core_fixtures import BULLETIN, BULLETIN_REVISED, LOSSLESS, fresh, shared_engine
    from simllm_ros.serving import semantic_reuse
    from simllm_ros.request import CacheResult

    e = shared_engine(**LOSSLESS)
    if not e.backend.kernels_do_the_work:
        pytest.skip("the runner's products are torch's here")
    fresh(e)
    e.handle(QueryRequest(prompt="Which road is closed this week?", context=BULLETIN, cache_scope="alone",
                          max_new_tokens=4))
    ahead, rest = [], []
    real_ahead, real_count = semantic_reuse.ahead, compute_threads.kernel_threads

    def watched_ahead(*a, **kw):
        ahead.append(real_count())
        return real_ahead(*a, **kw)

    def watched_count():
        n = real_count()
        rest.append(n)
        return n
    monkeypatch.setattr(semantic_reuse, "ahead", watched_ahead)
    monkeypatch.setattr(compute_threads, "kernel_threads", watched_count)
    real_embed = e.fingerprinter._embed_batched

    def later_embed(texts):  # the pass ahead runs only while the fingerprint is not done: not a race to lose
        time.sleep(0.5)
        return real_embed(texts)
    monkeypatch.setattr(e.fingerprinter, "_embed_batched", later_embed)
    e.fingerprinter.forget()
    r = e.handle(QueryRequest(prompt="Which street is shut this week?", context=BULLETIN_REVISED, cache_scope="alone",
                              max_new_tokens=4, allow_approximate=True))
    assert r.success and r.cache_result == CacheResult.SEMANTIC, (r.cache_result, r.error)
    assert ahead == [1] and 1 in rest and rest[-1] == 2  # the pass ahead on one worker, decoding on two
