#!/usr/bin/env python3
"""Escalated-stop trials: does the pool survive the way processes really get stopped?

Runs `simllm-edge` (python -m simllm_ros.cli.edge) as a real process on its own ROS domain, with a
persist_path and a short persist_interval_s, and for each trial:
  1. starts it on the snapshot the previous trial left, and checks that it restored every entry of
     that snapshot, and that the snapshot holds every entry the previous trial expected;
  2. asks a few short questions over the Query service (they are cached: expected from now on);
  3. starts long answers (in flight), then stops the process the way the trial says:
       int_term:d   SIGINT, SIGTERM d s later, SIGKILL 5 s after that (ros2 launch's escalation)
       double_int:d SIGINT, a second SIGINT d s later, SIGKILL 10 s after the first
       during_save  SIGINT, then SIGTERM + SIGINT as soon as a save is seen in progress, SIGKILL at 10 s
       kill9:t      no warning: SIGKILL t s into a stream of short questions
  4. expects: every entry answered before the first signal; after a clean exit also every answer that
     arrived after it (in flight, finished during the stop); after kill9 every entry answered at least
     persist_interval_s + 2 s (checkpoint tick and write) before the kill.
A last start checks the last trial. Real processes, real signals, real files; nothing is mocked.

    .venv/bin/python scripts/stop_trials.py                 # the 20 trials (about 12-15 min on 2 cores)
    .venv/bin/python scripts/stop_trials.py --trials int_term:0.5,kill9:6 --keep /tmp/trials
Exit code 0 when every trial held. The suite runs a 2-trial smoke version (test/cli/test_stop_trials.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

NODE = "stop_trial_node"
INTERVAL_S = 3.0  # persist_interval_s of the trial node
LAUNCH_SIGKILL_AFTER_S = 5.0  # ros2 launch: SIGTERM after sigterm_timeout, SIGKILL after sigkill_timeout (5 s each)

DEFAULT_TRIALS = (
    # SIGINT then SIGTERM at 0.1-5 s; short answers in flight (they finish within the escalation)
    ["int_term:0.1", "int_term:0.3", "int_term:0.5", "int_term:1", "int_term:2", "int_term:3", "int_term:4",
     "int_term:5"]
    # the same with long answers in flight: SIGKILL lands while they run
    + ["int_term_long:0.5", "int_term_long:2", "int_term_long:5"]
    + ["double_int:0.05", "double_int:0.2", "double_int:1"]
    + ["during_save", "during_save", "during_save"]
    + ["kill9:6", "kill9:8", "kill9:10"])
SMOKE_TRIALS = ["int_term:0.5", "kill9:7"]


def say(msg: str) -> None:
    print(f"[stop_trials] {msg}", flush=True)


@dataclasses.dataclass
class TrialResult:
    kind: str
    exit: str = ""  # "rc 0", "SIGKILL", ...
    stop_s: float = 0.0  # first signal -> process gone
    answered_before: int = 0  # short questions answered before the stop
    inflight_sent: int = 0  # long questions not yet answered when the first signal was sent
    inflight_answered: int = 0  # of those, answered during the stop
    expected: int = 0  # entries the next start must find
    save_hit: bool | None = None  # during_save: a signal landed while a save was in progress
    restored: int = -1  # filled by the next start
    missing: list = dataclasses.field(default_factory=list)
    ok: bool | None = None


def snapshot_questions(persist: str) -> set[tuple[str, str]] | None:
    """(scope, question) of every entry in the snapshot file, or None when there is none."""
    from safetensors import safe_open
    path = os.path.join(persist, "kv_pool.safetensors")
    if not os.path.exists(path):
        return None
    with safe_open(path, framework="pt") as f:
        manifest = json.loads(f.metadata()["manifest"])
    return {(e["scope"], e["question"]) for e in manifest["entries"]}


class Client:
    """An rclpy client node in its own context, spun in a thread."""

    def __init__(self):
        import rclpy
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor

        from simllm_ros.ros.qos import CLIENT_QOS
        from simllm_ros.srv import Query
        self.context = Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(f"stop_trials_client_{os.getpid()}", context=self.context)
        self.cli = self.node.create_client(Query, f"/{NODE}/query", qos_profile=CLIENT_QOS)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self):
        from rclpy.executors import ExternalShutdownException
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def ask_async(self, prompt: str, scope: str, max_new_tokens: int, on_answer, wait_s: float = 60.0):
        from simllm_ros.srv import Query
        # Each trial starts a new node: a request sent before discovery has matched its server is lost (DDS
        # delivers nothing to a reader it does not know yet), and the answer it waits for never comes.
        if not self.cli.service_is_ready() and not self.cli.wait_for_service(timeout_sec=wait_s):
            raise TimeoutError(f"/{NODE}/query not discovered within {wait_s} s")
        fut = self.cli.call_async(Query.Request(prompt=prompt, cache_scope=scope, max_new_tokens=max_new_tokens,
                                                allow_approximate=True))
        fut.add_done_callback(lambda f: on_answer(f.result(), time.monotonic()))
        return fut

    def ask(self, prompt: str, scope: str, max_new_tokens: int, timeout: float = 120.0, retry_s: float = 15.0):
        """The answer and when it came; the request is sent again after each `retry_s` without one. Fast DDS
        drops a response when the server has not matched the client's response reader within 100 ms (the rmw's
        "client will not receive response", only a warning in the node): with a node started a moment ago on a
        busy machine, a first request can be answered and never arrive. Sending a question again is harmless (a
        repeat); the first answer to arrive is taken."""
        done = threading.Event()
        box = {}

        def got(res, t):
            if not done.is_set():
                box["res"], box["t"] = res, t
                done.set()
        deadline = time.monotonic() + timeout
        while True:
            self.ask_async(prompt, scope, max_new_tokens, got)
            if done.wait(min(retry_s, max(0.0, deadline - time.monotonic()))):
                return box["res"], box["t"]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer to {prompt!r} within {timeout} s")
            say(f"  (no answer to {prompt!r} within {retry_s:g} s: asking again)")

    def close(self):
        import rclpy
        self.executor.shutdown(timeout_sec=5)
        self.thread.join(timeout=10)
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


class EdgeProcess:
    def __init__(self, persist: str, thermal: str, env: dict, log_path: str):
        self.lines: list[str] = []
        self.log = open(log_path, "a")
        cmd = [sys.executable, "-m", "simllm_ros.cli.edge", "--cache_size", "256MB",
               "--param", f"persist_path={persist}", "--param", f"persist_interval_s={INTERVAL_S}",
               "--param", f"thermal_root={thermal}", "--param", "enable_semantic_reuse=false",
               "--param", "refresh_period_s=0.0", "--param", "queue_limit=16",
               "--param", "max_new_tokens_limit=512", "--ros-args", "-r", f"__node:={NODE}"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_active(self, timeout: float = 240.0) -> int:
        """Wait for 'active'; returns how many entries the node said it restored."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simllm-edge exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            if any("active: service" in ln for ln in self.lines):
                m = re.search(r"restored (\d+) cached entries", self.text())
                return int(m.group(1)) if m else -1
            time.sleep(0.1)
        raise TimeoutError(f"simllm-edge not active after {timeout} s:\n{self.text()[-3000:]}")

    def signal(self, sig) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait_exit(self, kill_at: float | None) -> tuple[str, float]:
        """Wait for the process; SIGKILL it at monotonic time kill_at (if given). Returns (how, when)."""
        killed = False
        while self.proc.poll() is None:
            if kill_at is not None and not killed and time.monotonic() >= kill_at:
                self.signal(signal.SIGKILL)
                killed = True
            time.sleep(0.02)
        t = time.monotonic()
        self.reader.join(timeout=5)
        self.log.close()
        rc = self.proc.returncode
        return ("SIGKILL" if killed else f"rc {rc}"), t


def _partial_busy(persist: str) -> bool:
    p = os.path.join(persist, ".partial")
    try:
        return any(n.startswith("kv_pool.") for n in os.listdir(p))
    except OSError:
        return False


def run_trials(kinds: list[str], workdir: str, log=say) -> list[TrialResult]:
    from simllm_ros.ros.domain import pick_domain
    from simllm_ros.validation import normalize_text

    persist = os.path.join(workdir, "pool")
    thermal = os.path.join(workdir, "thermal")
    os.makedirs(os.path.join(thermal, "thermal_zone0"), exist_ok=True)
    with open(os.path.join(thermal, "thermal_zone0", "type"), "w") as f:
        f.write("cpu-thermal\n")
    with open(os.path.join(thermal, "thermal_zone0", "temp"), "w") as f:
        f.write("45000\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
    env.setdefault("ROS_DOMAIN_ID", str(pick_domain(os.getpid())))
    os.environ["ROS_DOMAIN_ID"] = env["ROS_DOMAIN_ID"]  # the client joins the same domain
    log_path = os.path.join(workdir, "edge.log")
    client = Client()
    results: list[TrialResult] = []
    expected: set[tuple[str, str]] = set()
    try:
        for i, kind in enumerate(kinds + [None]):
            edge = EdgeProcess(persist, thermal, env, log_path)
            try:
                restored = edge.wait_active()
                in_file = snapshot_questions(persist) or set()
                if results:  # check the previous trial
                    prev = results[-1]
                    prev.restored = restored
                    prev.missing = sorted(expected - in_file)
                    # A stop that was not SIGKILLed must exit 0, whatever signals came after the first.
                    clean_exit = prev.exit in ("SIGKILL", "rc 0")
                    prev.ok = not prev.missing and restored == len(in_file) and clean_exit
                    if not clean_exit:
                        log(f"  -> the stop exited with {prev.exit}, not 0")
                    log(f"  -> restart restored {restored} entries (file holds {len(in_file)}); expected "
                        f"{len(expected)}, missing {len(prev.missing)}: {'OK' if prev.ok else 'FAILED'}")
                    if expected:  # a restored entry really serves: exact prefix reuse of all but one token
                        scope, q = sorted(expected)[0]
                        r, _ = client.ask(q, scope, 2)
                        if not (r.success and r.cache_result == 1 and r.reused_tokens == r.prompt_tokens - 1):
                            prev.ok = False
                            log(f"  -> re-asking {q!r} did not reuse the restored KV: tier {r.cache_result}, "
                                f"{r.reused_tokens}/{r.prompt_tokens} ({r.error})")
                if kind is None:
                    edge.signal(signal.SIGINT)
                    edge.wait_exit(time.monotonic() + 60)
                    break
                results.append(_one_trial(i, kind, edge, client, persist, expected, normalize_text, log))
            finally:
                if edge.proc.poll() is None:
                    edge.signal(signal.SIGKILL)
                    edge.proc.wait()
    finally:
        client.close()
    return results


def _one_trial(i, kind, edge, client, persist, expected, normalize_text, log) -> TrialResult:
    res = TrialResult(kind)
    name, _, arg = kind.partition(":")
    d = float(arg) if arg else 0.0
    scope = f"trial{i}"
    answered: list[tuple[tuple[str, str], float]] = []  # (scope, question), time answered
    lock = threading.Lock()

    def record(prompt):
        def cb(r, t):
            if r.success:
                with lock:
                    answered.append(((scope, normalize_text(prompt)), t))
        return cb

    if name == "kill9":  # a stream of short questions, SIGKILL without warning at d s
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < d:
            p = f"Trial {i} question {n}: name one colour of the sky."
            r, t = client.ask(p, scope, 4)
            record(p)(r, t)
            n += 1
        t_kill = time.monotonic()
        edge.signal(signal.SIGKILL)
        res.exit, t_end = edge.wait_exit(None)
        res.exit = "SIGKILL"
        res.stop_s = t_end - t_kill
        res.answered_before = len(answered)
        bound = t_kill - (INTERVAL_S + 2.0)
        must = {k for k, t in answered if t <= bound}
        expected.clear()
        expected.update(must)
        res.expected = len(must)
        log(f"trial {i + 1} {kind}: {len(answered)} answered in {d:.0f} s, SIGKILL; expecting the "
            f"{len(must)} answered more than {INTERVAL_S + 2:.0f} s before the kill")
        return res

    for n in range(3):  # cached before the stop
        p = f"Trial {i} short question {n}: what is {n} plus {i}?"
        r, t = client.ask(p, scope, 4)
        if not r.success:
            raise RuntimeError(f"trial {i}: {r.error}")
        record(p)(r, t)
    res.answered_before = len(answered)
    long_tokens = 300 if name == "int_term_long" else 24
    n_inflight = 2
    long_prompts = [f"Trial {i} long question {n}: describe a walk through a city park in spring."
                    for n in range(n_inflight)]
    for p in long_prompts:
        client.ask_async(p, scope, long_tokens, record(p))
    time.sleep(1.0)  # the first long answer is generating, the second waits
    before = {k for k, _ in answered}
    res.inflight_sent = sum((scope, normalize_text(p)) not in before for p in long_prompts)
    t_sig = time.monotonic()
    edge.signal(signal.SIGINT)
    if name in ("int_term", "int_term_long"):
        time.sleep(d)
        edge.signal(signal.SIGTERM)
        kill_at = t_sig + d + LAUNCH_SIGKILL_AFTER_S
    elif name == "double_int":
        time.sleep(d)
        edge.signal(signal.SIGINT)
        kill_at = t_sig + 10.0
    elif name == "during_save":
        res.save_hit = False
        deadline = t_sig + 8.0
        while time.monotonic() < deadline and edge.proc.poll() is None:
            if _partial_busy(persist):
                edge.signal(signal.SIGTERM)
                edge.signal(signal.SIGINT)
                res.save_hit = True
                break
            time.sleep(0.001)
        kill_at = t_sig + 10.0
    else:
        raise ValueError(f"unknown trial {kind!r}")
    res.exit, t_end = edge.wait_exit(kill_at)
    res.stop_s = t_end - t_sig
    time.sleep(0.3)  # replies sent just before the exit
    with lock:
        after = {k for k, _ in answered}
    res.inflight_answered = len(after - before)
    must = set(before) if res.exit == "SIGKILL" else set(after)
    expected.clear()
    expected.update(must)
    res.expected = len(must)
    extra = f", save hit: {res.save_hit}" if res.save_hit is not None else ""
    log(f"trial {i + 1} {kind}: {len(before)} cached before the stop, {res.inflight_answered}/"
        f"{res.inflight_sent} in flight at the signal answered; exit {res.exit} after {res.stop_s:.1f} s{extra}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", default=",".join(DEFAULT_TRIALS),
                    help="comma-separated: int_term:D, int_term_long:D, double_int:D, during_save, kill9:T")
    ap.add_argument("--smoke", action="store_true", help=f"only {SMOKE_TRIALS}")
    ap.add_argument("--keep", help="work folder to keep (default: a temp folder, removed)")
    args = ap.parse_args(argv)
    kinds = SMOKE_TRIALS if args.smoke else [k.strip() for k in args.trials.split(",") if k.strip()]
    workdir = args.keep or tempfile.mkdtemp(prefix="stop_trials.")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.monotonic()
    try:
        results = run_trials(kinds, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    ok = sum(bool(r.ok) for r in results)
    stops = [r.stop_s for r in results]
    say(f"{ok}/{len(results)} trials held; stop took {min(stops):.1f}-{max(stops):.1f} s; "
        f"SIGKILLed {sum(r.exit == 'SIGKILL' for r in results)}; "
        f"in-flight answered {sum(r.inflight_answered for r in results)}/{sum(r.inflight_sent for r in results)}; "
        f"signals during a save {sum(bool(r.save_hit) for r in results)}/"
        f"{sum(r.save_hit is not None for r in results)}; {time.monotonic() - t0:.0f} s")
    for r in results:
        if not r.ok:
            say(f"FAILED {r.kind}: restored {r.restored}, missing {r.missing[:5]}")
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
