"""Escalated stops of a real simllm-edge process (smoke: 2 trials; the 20-trial run is scripts/stop_trials.py).

int_term:0.5 : SIGINT with two answers in flight, SIGTERM 0.5 s later (as ros2 launch escalates),
               SIGKILL 5 s after that if still alive. The restart must restore every entry cached
               before the stop, and after a clean exit also the answers that finished during it.
kill9:7      : SIGKILL with no warning 7 s into a stream of questions: the restart must restore every
               entry answered more than persist_interval_s (3 s) + 2 s before the kill.
A third start checks the second trial, and re-asks a restored question (exact-prefix reuse of its KV).
"""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import stop_trials  # noqa: E402


def test_escalated_stops_keep_the_pool(tmp_path):
    pytest.importorskip("rclpy")  # the trials ask simllm-edge processes over DDS
    results = stop_trials.run_trials(stop_trials.SMOKE_TRIALS, str(tmp_path))
    assert len(results) == 2
    for r in results:
        print(f"\n{r.kind}: exit {r.exit} after {r.stop_s:.1f} s, expected {r.expected}, restored {r.restored}, "
              f"missing {r.missing}")
        assert r.ok, r
    int_term, kill9 = results
    assert int_term.answered_before == 3 and int_term.expected >= 3
    assert kill9.exit == "SIGKILL" and kill9.expected >= 1, "the kill9 trial expected nothing: it tested nothing"
