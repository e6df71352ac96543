"""Robot-facing interfaces through real DDS: the ~/generate action, json_schema, messages, ~/embed.

One node for the module (real rclpy, the real model, lossless reuse on this CPU). Tests run in file order and
each brings the node to the state it needs. The claims:
- ~/generate streams growing partial text as feedback and succeeds with the Query fields in its result;
- a cancel ends a running goal CANCELED within 2 s, a queued one at once, with nothing half-written in the pool;
  cancelling a finished goal is answered ERROR_GOAL_TERMINATED;
- goals share the service's admission: a goal beyond queue_limit, or while inactive, is aborted with the reason;
- json_schema answers validate, on the service, the topic and the action; a bad schema gets a clear error;
- messages (chat turns) work on the service, topic and action; bad turns get a clear error;
- ~/embed returns unit vectors from the loaded MiniLM and refuses bad input;
- ~/rerank orders documents by that MiniLM's cosine to a query, refuses bad input with the reason, the node
  answering on.
"""
import json
import math
import threading
import time
import uuid

import jsonschema
import numpy as np
import pytest
from action_msgs.msg import GoalStatus
from action_msgs.srv import CancelGoal

from conftest import wait_future, wait_until
from simllm_ros.action import Generate
from simllm_ros.msg import ChatMessage
from simllm_ros.request import CacheResult
from simllm_ros.srv import Embed, Query, Rerank

NODE = "simllm_node"
BULLETIN = ("Riverside bulletin. Elm Street is closed from 09:00 to 17:00 for water main repairs; use Oak Avenue. "
            "Light rain after 15:00. Bus line 12 runs every 15 minutes until 20:00.")
SCHEMA = {"type": "object",
          "properties": {"road": {"type": "string", "enum": ["Elm Street", "Oak Avenue", "Route 9"]},
                         "closed": {"type": "boolean"}},
          "required": ["road", "closed"]}


@pytest.fixture(scope="module")
def h(ros_harness_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("interfaces")
    yaml = d / "test.yaml"
    yaml.write_text(f"{NODE}:\n  ros__parameters:\n    cache_size: \"48MB\"\n    max_new_tokens: 12\n"
                    "    queue_limit: 4\n    telemetry_period_s: 0.5\n    ttft_warn_ms: 600000.0\n")
    return ros_harness_factory(NODE, [str(yaml)])


CANCEL_S = 5.0  # a cancel takes effect within a step; generating the rest would take ~20 s


def send_goal(h, feedback=None, **fields):
    assert h.generate_cli.wait_for_server(timeout_sec=10), "~/generate not available"
    fields.setdefault("context", BULLETIN)
    gh = wait_future(h.generate_cli.send_goal_async(Generate.Goal(**fields), feedback_callback=feedback), 20)
    assert gh.accepted, "a goal is accepted (refusals are aborted with the reason)"
    return gh


def outcome(gh, timeout=120):
    r = wait_future(gh.get_result_async(), timeout)
    return r.status, r.result


def test_goal_while_inactive_is_aborted_with_the_reason(h):
    h.ensure_active()
    assert h.change_state("deactivate")
    status, res = outcome(send_goal(h, prompt="Which road is closed?"))
    assert status == GoalStatus.STATUS_ABORTED
    assert not res.success and res.error == "node is not active (state: inactive)"
    emb = h.call(h.embed_cli, Embed.Request(texts=["hello"]))
    assert not emb.success and emb.error == "node is not active (state: inactive)"
    ranked = h.call(rerank_cli(h), Rerank.Request(query="hello", documents=["hi"]))
    assert not ranked.success and ranked.error == "node is not active (state: inactive)"
    assert h.change_state("activate")


def test_goal_streams_growing_text_and_succeeds(h):
    h.ensure_active()
    feedback = []
    gh = send_goal(h, feedback=lambda m: feedback.append(m.feedback), prompt="Tell me about the buses tonight.",
                   max_new_tokens=32, cache_scope="stream")
    status, res = outcome(gh)
    assert status == GoalStatus.STATUS_SUCCEEDED and res.success, res.error
    texts = [f.text for f in feedback]
    assert len(set(texts)) >= 3, texts  # the text grows while it is generated
    assert all(res.answer.startswith(t) for t in texts) and texts[-1] == res.answer
    assert [f.generated_tokens for f in feedback] == sorted(f.generated_tokens for f in feedback)
    assert feedback[-1].generated_tokens == res.generated_tokens and res.stop_reason in ("eos", "length")
    assert res.prompt_tokens > 0 and res.exact and res.ttft_ms > 0
    # the result's energy: a figure from this machine's sensor, or NaN and why (never 0 J for unknown)
    assert (math.isnan(res.energy_j) and res.energy_source.startswith("none: ")) or \
        (res.energy_j >= 0 and not res.energy_source.startswith("none")), (res.energy_j, res.energy_source)
    again = outcome(send_goal(h, prompt="Tell me about the buses tonight.", max_new_tokens=32, cache_scope="stream"))[1]
    assert again.answer == res.answer and again.cache_result == CacheResult.EXACT_PREFIX


def test_cancel_ends_a_running_goal_at_once_and_a_finished_one_says_terminated(h):
    h.ensure_active()
    first = threading.Event()
    gh = send_goal(h, feedback=lambda m: first.set(), prompt="Describe every road, bus and shop in the bulletin.",
                   max_new_tokens=400, cache_scope="cancel")
    assert first.wait(60), "no feedback before the cancel"
    t0 = time.monotonic()
    cancel = wait_future(gh.cancel_goal_async(), 10)
    assert cancel.return_code == CancelGoal.Response.ERROR_NONE and len(cancel.goals_canceling) == 1
    status, res = outcome(gh, 10)
    took = time.monotonic() - t0
    # 'At once' against the ~20 s the 400 tokens would take; the bound leaves room for this shared VM's pauses.
    assert status == GoalStatus.STATUS_CANCELED and took < CANCEL_S, (status, took)
    assert not res.success and res.stop_reason == "cancel" and res.error == "cancelled by the caller"
    assert 0 < res.generated_tokens < 400 and res.answer
    again = wait_future(gh.cancel_goal_async(), 10)
    assert again.return_code == CancelGoal.Response.ERROR_GOAL_TERMINATED and not again.goals_canceling
    print(f"\n[action] cancel -> CANCELED in {took * 1000:.0f} ms after {res.generated_tokens} tokens")
    # The pool holds the prompt's KV (test_chat_and_streaming checks that the partial answer is not stored):
    # the next identical goal reuses it and is answered in full.
    full = outcome(send_goal(h, prompt="Describe every road, bus and shop in the bulletin.", max_new_tokens=20,
                             cache_scope="cancel"))[1]
    assert full.success and full.cache_result == CacheResult.EXACT_PREFIX and full.answer.startswith(res.answer[:10])


def test_goals_share_the_admission_queue_and_a_queued_goal_cancels_at_once(h):
    h.ensure_active()
    # One request at a time (max_batch 1), so that the running goal holds the worker and the next one waits in
    # the queue; it must outlast the steps below on a busy VM: 400 tokens took ~4 s here once the layers ran
    # in C (layer_kernel), so it asks for 2000 and is cancelled at the end. (With batching a waiting goal joins
    # the batch within a step: that the queue was still full relied on slow steps.)
    assert all(r.successful for r in h.set_params(queue_limit=1, max_new_tokens_limit=2000, max_batch=1))
    try:
        started = threading.Event()
        running = send_goal(h, feedback=lambda m: started.set(), prompt="Describe the whole bulletin in detail.",
                            max_new_tokens=2000, cache_scope="busy")
        assert started.wait(60)
        queued = send_goal(h, prompt="Is the pharmacy open?", cache_scope="busy")
        status, res = outcome(send_goal(h, prompt="And the post office?", cache_scope="busy"), 20)
        assert status == GoalStatus.STATUS_ABORTED and res.error.startswith("busy: 1 requests already waiting")
        svc = h.query("And the post office?", scope="busy", timeout=20)  # the service sees the same queue
        assert not svc.success and svc.error.startswith("busy:")
        t0 = time.monotonic()
        wait_future(queued.cancel_goal_async(), 10)
        status, res = outcome(queued, 10)
        assert status == GoalStatus.STATUS_CANCELED and time.monotonic() - t0 < CANCEL_S
        assert res.generated_tokens == 0 and res.stop_reason == "cancel"
        wait_future(running.cancel_goal_async(), 10)
        assert outcome(running, 10)[0] == GoalStatus.STATUS_CANCELED
    finally:
        assert all(r.successful for r in h.set_params(queue_limit=4, max_new_tokens_limit=512, max_batch=8))


def test_json_schema_on_the_service_topic_and_action(h):
    h.ensure_active()
    schema = json.dumps(SCHEMA)
    q = "Which road is closed today? Answer in JSON with road and closed."
    res = h.call(h.query_cli, Query.Request(prompt=q, context=BULLETIN, json_schema=schema, max_new_tokens=32))
    assert res.success, res.error
    jsonschema.validate(json.loads(res.answer), SCHEMA)
    status, goal = outcome(send_goal(h, prompt=q, json_schema=schema, max_new_tokens=32))
    assert status == GoalStatus.STATUS_SUCCEEDED and json.loads(goal.answer) == json.loads(res.answer)
    rid = f"schema-{uuid.uuid4().hex[:6]}"
    after = len(h.messages(f"{h.fqn}/responses"))
    h.publish_request(rid, q, max_new_tokens=32, context=BULLETIN, json_schema=schema)
    msg = h.wait_message(f"{h.fqn}/responses", lambda m: m.request_id == rid, timeout=120, after=after)
    assert msg is not None and msg.success
    jsonschema.validate(json.loads(msg.answer), SCHEMA)
    # Bad schemas: a clear error on every interface, and the node keeps serving.
    bad = '{"type": "nonsense"}'
    r = h.call(h.query_cli, Query.Request(prompt=q, json_schema=bad))
    assert not r.success and r.error.startswith("json_schema is not a valid schema at /type: 'nonsense'")
    status, g = outcome(send_goal(h, prompt=q, json_schema="{not json"))
    assert status == GoalStatus.STATUS_ABORTED and g.error.startswith("json_schema is not valid JSON")
    h.publish_request(rid + "-bad", q, json_schema="[]")
    msg = h.wait_message(f"{h.fqn}/responses", lambda m: m.request_id == rid + "-bad", timeout=30, after=after)
    assert msg is not None and msg.error == "json_schema must be a JSON object (a schema), got list"
    assert h.query("Is it raining?", context=BULLETIN).success


def test_hostile_schemas_get_clear_replies_on_every_interface_and_ended_goals_stay_known(h):
    """Every hostile class and accepted schema of test_schema_promise (fixed-seed order) over DDS: the service,
    the topic and the action each answer a clear refusal or an answer valid under the schema; the node keeps
    serving. A goal aborted for its schema, cancelled 11 s later (past rclpy's default 10 s result keep), says
    ERROR_GOAL_TERMINATED."""
    from schema_cases import REFUSED, fuzz_cases

    h.ensure_active()
    q = "Describe the closed road as JSON."
    cases = fuzz_cases(seed=11)
    aborted = None
    for i, (text, reason) in enumerate(cases):
        replies = [h.call(h.query_cli, Query.Request(prompt=q, context=BULLETIN, json_schema=text,
                                                     max_new_tokens=40))]
        status, g = outcome(send_goal(h, prompt=q, context=BULLETIN, json_schema=text, max_new_tokens=40))
        replies.append(g)
        if reason is not None:
            assert status == GoalStatus.STATUS_ABORTED
            aborted = aborted or g
        rid = f"hostile-{i}-{uuid.uuid4().hex[:6]}"
        after = len(h.messages(f"{h.fqn}/responses"))
        h.publish_request(rid, q, max_new_tokens=40, context=BULLETIN, json_schema=text)
        msg = h.wait_message(f"{h.fqn}/responses", lambda m: m.request_id == rid, timeout=120, after=after)
        assert msg is not None
        replies.append(msg)
        for r in replies:
            if reason is not None:
                assert not r.success and r.error.startswith(reason), r.error
            elif r.success:
                jsonschema.validate(json.loads(r.answer), json.loads(text))
            assert "internal error" not in r.error
    gh = send_goal(h, prompt=q, json_schema=REFUSED[0][0])
    assert outcome(gh)[0] == GoalStatus.STATUS_ABORTED
    time.sleep(11)
    late = wait_future(gh.cancel_goal_async(), 10)
    assert late.return_code == CancelGoal.Response.ERROR_GOAL_TERMINATED and not late.goals_canceling
    assert h.query("Is it raining?", context=BULLETIN).success


def test_messages_on_the_service_topic_and_action(h):
    h.ensure_active()
    turn1 = [ChatMessage(role="user", content="Which road is closed today?")]
    r1 = h.call(h.query_cli, Query.Request(messages=turn1, context=BULLETIN, cache_scope="chat", max_new_tokens=12))
    assert r1.success, r1.error
    turn2 = turn1 + [ChatMessage(role="assistant", content=r1.answer),
                     ChatMessage(role="user", content="What should I use instead?")]
    status, r2 = outcome(send_goal(h, messages=turn2, cache_scope="chat", max_new_tokens=12))
    assert status == GoalStatus.STATUS_SUCCEEDED and r2.success
    assert r2.cache_result == CacheResult.EXACT_PREFIX and r2.reused_tokens >= r1.prompt_tokens and r2.exact
    rid = f"chat-{uuid.uuid4().hex[:6]}"
    after = len(h.messages(f"{h.fqn}/responses"))
    h.publish_request(rid, "", context=BULLETIN, cache_scope="chat",
                      messages=turn2 + [ChatMessage(role="assistant", content=r2.answer)], stop=["\n"])
    msg = h.wait_message(f"{h.fqn}/responses", lambda m: m.request_id == rid, timeout=60, after=after)
    assert msg is not None and not msg.success and msg.error.startswith("the conversation ends with a assistant turn")
    # Bad conversations: clear errors through DDS.
    r = h.call(h.query_cli, Query.Request(prompt="", messages=[]))
    assert not r.success and r.error.startswith("prompt is empty") and "no messages were given" in r.error
    status, g = outcome(send_goal(h, prompt="", messages=[ChatMessage(role="robot", content="hi")]))
    assert status == GoalStatus.STATUS_ABORTED and g.error == "messages[0].role 'robot' is not one of system, user, assistant"
    r = h.call(h.query_cli, Query.Request(prompt="hi", messages=[ChatMessage(role="user", content="")]))
    assert not r.success and r.error.startswith("messages[0].content is empty")


def test_stop_strings_and_per_request_sampling_on_the_service(h):
    h.ensure_active()
    full = h.call(h.query_cli, Query.Request(prompt="Describe the weather today.", context=BULLETIN, max_new_tokens=24))
    assert full.success and full.answer
    word = " " + full.answer.split()[len(full.answer.split()) // 2]
    cut = h.call(h.query_cli, Query.Request(prompt="Describe the weather today.", context=BULLETIN,
                                            max_new_tokens=24, stop=[word]))
    assert cut.success and cut.stop_reason == "stop" and cut.answer == full.answer[:full.answer.find(word)].rstrip()
    a, b = (h.call(h.query_cli, Query.Request(prompt="Say hello.", temperature=1.0, seed=9, max_new_tokens=10))
            for _ in range(2))
    assert a.success and a.answer == b.answer
    r = h.call(h.query_cli, Query.Request(prompt="Say hello.", temperature=7.5))
    assert not r.success and r.error.startswith("temperature must be between 0 and 5.0")


def test_embed_service(h):
    h.ensure_active()
    texts = ["is it going to rain today", "will it rain this afternoon", "where can I buy diesel"]
    r = h.call(h.embed_cli, Embed.Request(texts=texts))
    assert r.success, r.error
    assert r.dim == 384 and len(r.vectors) == 3 * 384
    v = np.asarray(r.vectors, dtype=np.float32).reshape(3, r.dim)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert float(v[0] @ v[1]) > float(v[0] @ v[2]) + 0.2
    for texts, reason in (([], "texts is empty"), (["fine", ""], "texts[1] is empty"),
                          (["x"] * 300, "300 texts; at most 256 per call")):
        r = h.call(h.embed_cli, Embed.Request(texts=texts))
        assert not r.success and r.error.startswith(reason) and not r.vectors, r.error
    assert wait_until(lambda: h.call(h.embed_cli, Embed.Request(texts=["still here"])).success, 10)


def rerank_cli(h):
    from simllm_ros.ros.qos import CLIENT_QOS
    if getattr(h, "rerank_cli", None) is None:
        h.rerank_cli = h.client.create_client(Rerank, f"/{NODE}/rerank", qos_profile=CLIENT_QOS)
    return h.rerank_cli


def test_rerank_service(h):
    h.ensure_active()
    docs = ["The pharmacy on Oak Avenue closes at 19:00.", "Light rain is expected after three this afternoon.",
            "Bus line 12 runs every 15 minutes.", "Will it rain later today?"]
    query = "is it going to rain this afternoon"
    r = h.call(rerank_cli(h), Rerank.Request(query=query, documents=docs))
    assert r.success and not r.error, r.error
    assert sorted(r.indices) == [0, 1, 2, 3] and set(r.indices[:2]) == {1, 3}
    v = h.node._engine.fingerprinter.embed([query] + docs)
    assert np.allclose(r.scores, (v[1:] @ v[0])[list(r.indices)], atol=1e-5)
    assert list(r.scores) == sorted(r.scores, reverse=True)
    top = h.call(rerank_cli(h), Rerank.Request(query=query, documents=docs, top_k=1))
    assert top.success and list(top.indices) == [r.indices[0]] and len(top.scores) == 1
    for req, reason in ((Rerank.Request(query="", documents=docs), "query is empty"),
                        (Rerank.Request(query=query, documents=[]), "documents is empty"),
                        (Rerank.Request(query=query, documents=["fine", "a\x07b"]),
                         "documents[1] contains control character U+0007"),
                        (Rerank.Request(query=query, documents=["x"] * 300), "300 documents; at most 256 per call"),
                        (Rerank.Request(query=query, documents=["word " * 400]), "documents[0] is 402 tokens")):
        bad = h.call(rerank_cli(h), req)
        assert not bad.success and bad.error.startswith(reason) and not bad.indices and not bad.scores, bad.error
    assert h.call(rerank_cli(h), Rerank.Request(query=query, documents=docs[:1])).success  # the node answers on


def test_the_client_library_reranks_as_the_service_does(h):
    """SimllmClient.rerank over DDS: the service's ranking as (index, score) pairs, best first; top_k; a refusal
    fails the future with ValueError carrying the node's reason."""
    from simllm_ros.ros.client import SimllmClient

    h.ensure_active()
    docs = ["The pharmacy on Oak Avenue closes at 19:00.", "Light rain is expected after three this afternoon.",
            "Bus line 12 runs every 15 minutes.", "Will it rain later today?"]
    query = "is it going to rain this afternoon"
    client = SimllmClient(f"/{NODE}", context=h.context)
    try:
        ranked = client.rerank(query, docs).result(60)
        direct = h.call(rerank_cli(h), Rerank.Request(query=query, documents=docs))
        assert [i for i, _ in ranked] == list(direct.indices) and {i for i, _ in ranked[:2]} == {1, 3}
        assert np.allclose([s for _, s in ranked], direct.scores)
        assert client.rerank(query, docs, top_k=1).result(60) == ranked[:1]
        with pytest.raises(ValueError, match="documents is empty"):
            client.rerank(query, []).result(60)
    finally:
        client.close()


def test_the_client_library_answers_inside_a_timer_callback_and_cancels(h):
    """simllm_ros.ros.client over DDS: blocking on its futures inside another node's timer callback (a single
    threaded executor: the classic deadlock of a blocking service call) returns the node's answers; refusals come
    back as responses with the reason; embed gives unit vectors; a goal streams feedback and cancels; a node that
    is not there fails the future with TimeoutError."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from simllm_ros.ros.client import SimllmClient

    h.ensure_active()
    client = SimllmClient(f"/{NODE}", context=h.context)
    user = rclpy.create_node(f"user_{uuid.uuid4().hex[:6]}", context=h.context)
    executor = SingleThreadedExecutor(context=h.context)
    executor.add_node(user)
    got, done = {}, threading.Event()

    def tick():
        timer.cancel()
        try:
            got["answer"] = client.query("Is Elm Street closed?", context=BULLETIN, max_new_tokens=8).result(60)
            got["refused"] = client.query("hi", json_schema='{"not": {}}').result(30)
            got["vectors"] = client.embed(["parking nearby", "nearest parking lot"]).result(30)
        finally:
            done.set()

    timer = user.create_timer(0.05, tick)
    spinner = threading.Thread(target=lambda: [executor.spin_once(timeout_sec=0.1) for _ in iter(done.is_set, True)],
                               daemon=True)
    spinner.start()
    try:
        assert done.wait(150), "the timer callback did not come back"
        assert got["answer"].success and got["answer"].answer, got["answer"].error
        assert not got["refused"].success and "keyword 'not'" in got["refused"].error
        v = np.array(got["vectors"])
        assert v.shape == (2, 384) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-3)
        texts = []
        run = client.generate("Describe every road, bus and shop in the bulletin.", context=BULLETIN,
                              max_new_tokens=300, on_feedback=texts.append)
        assert wait_until(lambda: bool(texts), 60), "no feedback"
        run.cancel()
        res = run.result.result(30)
        assert not res.success and res.stop_reason == "cancel" and res.answer.startswith(texts[0])
        nobody = SimllmClient("/nobody_here", context=h.context, wait_s=0.5)
        assert isinstance(nobody.query("x", timeout=2).exception(10), TimeoutError)
        nobody.close()
    finally:
        spinner.join(5)
        executor.shutdown()
        user.destroy_node()
        client.close()


def test_the_client_asks_again_only_until_a_service_has_answered_it(h):
    """A request left unanswered for resend_s is sent again, but only before the service has answered this client
    once (Fast DDS may drop a new client's first responses unseen) and at most twice; each future settles once with
    the node's answer, the resent question is answered the same, and once an answer came nothing is sent twice."""
    from simllm_ros.ros.client import SimllmClient

    h.ensure_active()
    client = SimllmClient(f"/{NODE}", context=h.context, resend_s=0.02)
    try:
        question = dict(context=BULLETIN, max_new_tokens=24, cache_scope=f"resend-{uuid.uuid4().hex[:6]}")
        first = client.query("Which roads are closed this week, and why?", **question).result(120)
        assert first.success and first.answer, first.error
        assert client.resends == 2, "a 24-token answer takes longer than 40 ms: the question was not sent twice more"
        after = client.resends
        again = client.query("Which roads are closed this week, and why?", **question).result(120)
        other = client.query("Is the bus on time?", **question).result(120)
        assert again.success and again.answer == first.answer and other.success, (again.error, other.error)
        assert client.resends == after, "sent again after the service had answered"
        # another client's first question: asked again as well; both answered alike
        late = SimllmClient(f"/{NODE}", context=h.context, resend_s=0.02)
        try:
            assert late.query("Is the bus on time?", **question).result(120).answer == other.answer
            assert late.resends <= 2
        finally:
            late.close()
    finally:
        client.close()


def test_the_readme_client_examples_run_as_written(h):
    """The README's client examples (marked 'client example'), run in order as written against a live node,
    with `bulletin` and `speak` given."""
    import os
    import re

    import rclpy

    h.ensure_active()
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md"),
              encoding="utf-8") as f:
        readme = f.read()
    blocks = re.findall(r"<!-- client example[^>]*-->\n```python\n(.*?)```", readme, re.S)
    assert len(blocks) == 2, "the README's client examples are marked"
    spoken = []
    scope = {"bulletin": BULLETIN, "speak": spoken.append, "__name__": "readme_example"}
    try:
        for code in blocks:
            exec(compile(code, "README.md", "exec"), scope)
        assert scope["reply"].success and scope["reply"].answer
        assert len(scope["vectors"]) == 2 and len(scope["vectors"][0]) == 384
        assert [i for i, _ in scope["ranked"]] == [1, 0]  # the charging dock first, as the README says
        assert scope["result"].stop_reason in ("cancel", "eos", "length")  # cancelled at once, or already done
    finally:
        if "client" in scope:
            scope["client"].close()
        rclpy.try_shutdown()


def test_the_rviz_config_and_the_plot_list_match_what_the_node_publishes():
    """config/cache_map.rviz shows ~/cache_map in the markers' own frame (nothing publishes a transform for
    it), and every line of config/rqt_plot.topics is a numeric field of the message on that topic."""
    import os

    import yaml

    from simllm_ros.msg import CacheStats, ThermalStatus
    from simllm_ros.settings import Settings

    cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "config")
    with open(os.path.join(cfg, "cache_map.rviz"), encoding="utf-8") as f:
        rviz = yaml.safe_load(f)
    vm = rviz["Visualization Manager"]
    assert vm["Global Options"]["Fixed Frame"] == Settings.from_overrides().cache_map_frame
    markers = [d for d in vm["Displays"] if d["Class"] == "rviz_default_plugins/MarkerArray"]
    assert markers and markers[0]["Topic"]["Value"] == f"/{NODE}/cache_map"
    assert markers[0]["Topic"]["Durability Policy"] == "Transient Local"  # the node latches the map
    types = {"cache_stats": CacheStats, "thermal": ThermalStatus}
    with open(os.path.join(cfg, "rqt_plot.topics"), encoding="utf-8") as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert len(lines) >= 8
    for ln in lines:
        _, node, topic, field = ln.split("/")
        assert node == NODE and field in types[topic].get_fields_and_field_types(), ln
        assert types[topic].get_fields_and_field_types()[field] in ("float", "uint32", "uint64"), ln


def test_the_speech_pipeline_speaks_sentences_and_a_new_utterance_cancels_the_old(h):
    import importlib.util
    import os

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from std_msgs.msg import String

    from simllm_ros.ros.client import SimllmClient

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                        "speech_pipeline.py")
    spec = importlib.util.spec_from_file_location("speech_pipeline", path)
    sp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sp)
    s = sp.SentenceSplitter()
    assert s.feed("Hello there. How") == ["Hello there."] and s.feed("Hello there. How are you? Fine") == \
        ["How are you?"] and s.feed("Hello there. How are you? Fine.") == [] and s.rest("Hello there. How are "
                                                                                        "you? Fine.") == "Fine."
    h.ensure_active()
    node = rclpy.create_node(f"speech_{uuid.uuid4().hex[:6]}", context=h.context)
    client = SimllmClient(f"/{NODE}", context=h.context)
    pipeline = sp.SpeechPipeline(node, client, context=BULLETIN, max_new_tokens=200)
    said = []
    listener = rclpy.create_node(f"ears_{uuid.uuid4().hex[:6]}", context=h.context)
    listener.create_subscription(String, f"{node.get_fully_qualified_name()}/say", lambda m: said.append(m.data), 10)
    pub = listener.create_publisher(String, f"{node.get_fully_qualified_name()}/utterances", 10)
    executor = SingleThreadedExecutor(context=h.context)
    executor.add_node(node)
    executor.add_node(listener)
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [executor.spin_once(timeout_sec=0.05) for _ in iter(stop.is_set, True)],
                               daemon=True)
    spinner.start()
    try:
        assert wait_until(lambda: pub.get_subscription_count() > 0, 10)
        pub.publish(String(data="Describe every road, bus and shop in the bulletin, one sentence each."))
        assert wait_until(lambda: pipeline.runs == 1 and pipeline._run is not None, 10)
        first = pipeline._run
        assert wait_until(lambda: bool(said), 90), "no sentence spoken"
        pub.publish(String(data="Is it going to rain?"))
        res = first.result.result(60)
        assert res.stop_reason == "cancel" and not res.success  # the barge-in cancelled the first answer
        assert wait_until(lambda: pipeline.runs == 2 and pipeline._run.result.done(), 90)
        assert all(x.strip() for x in said)
    finally:
        stop.set()
        spinner.join(5)
        executor.shutdown()
        client.close()
        node.destroy_node()
        listener.destroy_node()
