"""The lifecycle node `simllm_node`: adapts the Engine and its RequestServer to ROS 2.

Transitions (one callback each, as in ros2/demos lifecycle_py):
  configure  : parameters -> Settings -> Engine.load() (model, embedder, pool restore, warm-up);
               starts the request server's worker; creates the publishers.
               Any failure logs one clear line, releases everything and returns FAILURE.
  activate   : starts the telemetry timer, enables the lifecycle publishers, opens admission;
               the first activate creates the Query service and the request subscription.
  deactivate : refuses new requests, checkpoints the pool (if it changed), waits for the in-flight
               ones, keeps the pool.
  cleanup    : saves the pool (if it changed since the last checkpoint), unloads the model, destroys
               the entities.
  shutdown   : the same from any state.
With persist_path set, a Checkpointer also saves the pool every persist_interval_s when it changed, so
a SIGKILL loses at most that interval; a stop checkpoints before it waits for the answers in flight.

Who sees what: every subscriber of ~/responses sees every topic answer (prompt answers of all scopes);
with responses_per_scope they go to ~/responses/<scope> instead ("" -> ~/responses/default), one topic
per scope that SROS2 permissions can grant separately. ~/cache_map names no scope: its marker
namespaces are salted digests (cache_map.scope_tag), random per process. Service answers go only to
the caller.

Requests (service `~/query`, topic `~/requests` -> `~/responses`, action `~/generate`) go to
request_server.RequestServer, which admits, queues and answers each exactly once; its prepare step
(validation, schema compile, fingerprint) runs in the calling callback, which belongs to the reentrant
"matching" group, so several requests are fingerprinted while another one generates on the server's
own worker thread. The action streams the answer so far as feedback and cancels through the job's
should_stop. `~/embed` runs the embedder directly (no queue: it does not touch the model). Health
(/diagnostics, named after the node's full name) is health.assess; the cache map is
cache_map.spheres. The executor must be a MultiThreadedExecutor; `make_executor()` sizes one.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from typing import Callable

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import Point
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile
from std_msgs.msg import ColorRGBA
from visualization_msgs.msg import Marker, MarkerArray

from simllm_ros import cache_map, health
from simllm_ros.checkpoint import Checkpointer
from simllm_ros.engine import Engine, EngineLoadError
from simllm_ros.kernels.build import CONTRACT as NUMERICS_CONTRACT
from simllm_ros.action import Generate
from simllm_ros.msg import CacheStats, QueryRequest as QueryRequestMsg, QueryResponse, ThermalStatus
from simllm_ros.request import CacheResult, ChatTurn, Progress, QueryRequest, QueryResult
from simllm_ros.request_server import DRAIN_TIMEOUT_S, RequestServer, internal_error, not_active_error
from simllm_ros.ros.params import ParameterGate, declare_all, settings_from_node, undeclared_names
from simllm_ros.ros.qos import REQUEST_QOS, RESPONSE_QOS
from simllm_ros.settings import SettingError, Settings
from simllm_ros.srv import Embed, Query
from simllm_ros.thermal import ThermalLevel, ThermalMonitor, ThermalReading

NODE_NAME = "simllm_node"
DIAGNOSTIC_TASK = "LLM service"  # the status is "<node's full name without the leading slash>: LLM service"
GOAL_POLL_S = 0.1  # a goal cancelled while it waits in the queue is withdrawn within this
# How long an ended goal's result and status are kept (rclpy's default is 10 s): within it a cancel of an ended
# goal, e.g. one aborted as busy, gets ERROR_GOAL_TERMINATED as for any ended goal, not ERROR_UNKNOWN_GOAL_ID.
GOAL_RESULT_KEEP_S = 900

_U32, _U64 = 2**32 - 1, 2**64 - 1


class _RosLogHandler(logging.Handler):
    """Forwards the engine's Python logging to the node's ROS logger (console and /rosout)."""

    def __init__(self, ros_logger):
        super().__init__(logging.INFO)
        self._ros = ros_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if record.exc_info:
                msg += "\n" + logging.Formatter().formatException(record.exc_info)
            if record.levelno >= logging.ERROR:
                self._ros.error(msg)
            elif record.levelno >= logging.WARNING:
                self._ros.warning(msg)
            elif record.levelno >= logging.INFO:
                self._ros.info(msg)
            else:
                self._ros.debug(msg)
        except Exception:  # logging must never raise into the engine
            pass


def _u32(v) -> int:
    return min(max(int(v), 0), _U32)


def _u64(v) -> int:
    return min(max(int(v), 0), _U64)


def _fill_result(msg, result: QueryResult):
    """Copy a QueryResult into a Query.Response or a QueryResponse message."""
    msg.success = bool(result.success)
    msg.error = str(result.error or "")
    msg.answer = str(result.answer or "")
    msg.cache_result = int(CacheResult(result.cache_result))
    msg.similarity = float(result.similarity)
    msg.prompt_tokens = _u32(result.prompt_tokens)
    msg.reused_tokens = _u32(result.reused_tokens)
    msg.recomputed_tokens = _u32(result.recomputed_tokens)
    msg.generated_tokens = _u32(result.generated_tokens)
    msg.ttft_ms = float(result.ttft_ms)
    msg.total_ms = float(result.total_ms)
    msg.exact = bool(result.exact)
    msg.draft_tokens_proposed = _u32(result.draft_tokens_proposed)
    msg.draft_tokens_accepted = _u32(result.draft_tokens_accepted)
    msg.decode_passes = _u32(result.decode_passes)
    msg.stop_reason = str(result.stop_reason or "")
    return msg


def _request_from(msg, request_id: str = "") -> QueryRequest:
    """A QueryRequest from a Query.Request, a QueryRequest message or a Generate goal (the same fields)."""
    return QueryRequest(prompt=msg.prompt, context=msg.context, cache_scope=msg.cache_scope,
                        max_new_tokens=int(msg.max_new_tokens), allow_approximate=bool(msg.allow_approximate),
                        request_id=request_id, messages=[ChatTurn(m.role, m.content) for m in msg.messages],
                        json_schema=msg.json_schema, stop=list(msg.stop),
                        temperature=None if msg.temperature < 0 else float(msg.temperature),
                        seed=None if msg.seed < 0 else int(msg.seed))


def diagnostic_name(full_name: str) -> str:
    """ROS convention (diagnostic_updater): '<node's full name without the leading slash>: <task>'."""
    return f"{full_name.lstrip('/')}: {DIAGNOSTIC_TASK}"


def namespaced_frame(frame: str, namespace: str) -> str:
    """A frame id prefixed by the node's namespace ('/robot1' -> 'robot1/simllm_cache'), tf2 style (no slash)."""
    ns = namespace.strip("/")
    return f"{ns}/{frame}" if ns else frame


class SimLLMNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        declare_all(self)  # raises SettingError for a bad value in the params file / overrides
        self.add_on_set_parameters_callback(ParameterGate(
            self, is_loaded=self._model_loaded, state_label=self.state_label,
            apply_live=self._apply_live))

        self.progress: Callable[[str], None] | None = None  # extra sink for load progress (the CLI prints)
        self._py_log = logging.getLogger(f"simllm_ros.node.{id(self):x}")
        self._py_log.setLevel(logging.INFO)
        self._log_handler = _RosLogHandler(self.get_logger())
        self._py_log.addHandler(self._log_handler)

        self._engine: Engine | None = None
        self._server: RequestServer | None = None
        self._checkpointer: Checkpointer | None = None
        self._map_salt = os.urandom(16)  # cache_map namespaces are scope tags, never scope names
        self._scope_pubs: dict[str, object] = {}  # responses_per_scope: topic -> publisher
        self._scope_pubs_lock = threading.Lock()
        self._monitor: ThermalMonitor | None = None
        self._thermal = health.ThermalState()
        self._health_window = health.RateWindow()
        # Query service callbacks still running: rclpy sends their reply after they return.
        self._calls = threading.Condition()
        self._service_calls = 0

        self._matching_group = ReentrantCallbackGroup()
        self._telemetry_group = MutuallyExclusiveCallbackGroup()
        self._srv = None
        self._embed_srv = None
        self._action = None
        self._sub = None
        self._pub_responses = None
        self._pub_stats = None
        self._pub_thermal = None
        self._pub_diag = None
        self._pub_map = None
        self._timer = None

    def _check_undeclared_parameters(self, parameter_list) -> None:
        """Name the undeclared parameter in the refusal (rclpy's own message lists none)."""
        from rclpy.exceptions import ParameterNotDeclaredException
        from rclpy.parameter import Parameter
        if not all(isinstance(p, Parameter) for p in parameter_list):
            raise TypeError(f"parameter must be instance of type '{Parameter!r}'")
        names = undeclared_names(self, parameter_list)
        if names and not self._allow_undeclared_parameters:
            raise ParameterNotDeclaredException(f"{names}; `ros2 param list {self.get_fully_qualified_name()}` "
                                                "shows the declared ones")

    # ---------------------------------------------------------------- lifecycle
    def state_label(self) -> str:
        try:
            return str(self._state_machine.current_state[1])
        except Exception:
            return "unknown"

    def _model_loaded(self) -> bool:
        """True from the start of configure until cleanup/shutdown is over: reload parameters are frozen."""
        return self._engine is not None or self.state_label() not in ("unconfigured", "finalized")

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        log = self.get_logger()
        try:
            settings = settings_from_node(self)
        except SettingError as e:
            log.error(f"configure failed: invalid parameters: {e}")
            return TransitionCallbackReturn.FAILURE
        log.info(f"configuring: model={settings.model} cache_size={settings.cache_size} device={settings.device}")
        engine = None
        try:
            monitor = ThermalMonitor(settings.thermal_root, settings.thermal_zones, settings.thermal_warn_c,
                                     settings.thermal_critical_c, settings.thermal_hysteresis_c)
            engine = Engine(settings, log=self._py_log)
            t0 = time.monotonic()
            engine.load(progress=self._progress)
            self._monitor = monitor
            self._server = RequestServer(
                prepare=engine.prepare, state=self.state_label,
                execute=lambda job: engine.execute(job.prepared, job.on_progress, job.should_stop),
                queue_limit=settings.queue_limit, has_idle_work=engine.has_idle_work, idle_work=engine.idle_work,
                on_busy=engine.record_rejected_busy, log=self._py_log,
                begin=lambda job: engine.begin(job.prepared, job.on_progress, job.should_stop), step=engine.step,
                max_batch=settings.max_batch)
            self._create_entities()
            self._server.start()
            if settings.persist_path:
                self._checkpointer = Checkpointer(engine.save, lambda: engine.settings.persist_interval_s,
                                                  self._py_log)
                self._checkpointer.start()
            self._engine = engine
            rep = engine.load_report
            log.info(f"configured in {time.monotonic() - t0:.1f} s: restored {rep.get('restored', 0)} cached "
                     f"entries, {rep.get('warmup', 0)} warm-up requests")
        except Exception as e:
            kind = "" if isinstance(e, EngineLoadError) else f"{type(e).__name__}: "
            log.error(f"configure failed: {kind}{e}")
            self._engine = None
            self._stop_server()
            self._destroy_entities()
            if engine is not None:
                try:
                    engine.unload()
                except Exception as e2:
                    log.warning(f"unload after failed configure: {e2}")
            self._monitor = None
            return TransitionCallbackReturn.FAILURE
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            ret = super().on_activate(state)  # enables the lifecycle publishers
            if ret != TransitionCallbackReturn.SUCCESS:
                return ret
            self._health_window.clear()
            self._read_thermal()  # shed load from the start if already critical
            self._timer = self.create_timer(float(self._engine.settings.telemetry_period_s), self._on_telemetry,
                                            callback_group=self._telemetry_group)
            self._server.open()
            self._create_request_entities()
            self.get_logger().info("active: serving ~/query, ~/requests, ~/generate and ~/embed")
            return TransitionCallbackReturn.SUCCESS
        except Exception as e:
            self.get_logger().error(f"activate failed: {type(e).__name__}: {e}")
            return TransitionCallbackReturn.FAILURE

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self._server is not None:
            self._server.close()
            self.checkpoint("deactivate")  # what is cached now survives even if the wait below is cut short
            self._server.drain("deactivate")
        self._destroy_timer()
        self.get_logger().info("inactive: requests are refused, the pool is kept")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._teardown("cleanup")
        super().on_cleanup(state)
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._teardown("shutdown")
        try:
            super().on_shutdown(state)
        except Exception as e:
            self.get_logger().warning(f"shutdown: {e}")
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.get_logger().error(f"error while in state '{state.label}': releasing everything")
        self._teardown("error")
        return TransitionCallbackReturn.SUCCESS

    def destroy_node(self):
        self._teardown("destroy", save=False)
        try:
            self._py_log.removeHandler(self._log_handler)
        except Exception:
            pass
        return super().destroy_node()

    def _progress(self, message: str) -> None:
        self.get_logger().info(f"configure: {message}")
        if self.progress is not None:
            try:
                self.progress(message)
            except Exception:
                pass

    def _teardown(self, why: str, save: bool = True) -> None:
        """Refuse, checkpoint, drain, save, unload, destroy: safe from any state and idempotent."""
        if self._server is not None:
            self._server.close()
        self._destroy_timer()
        if self._server is not None:
            if save:
                self.checkpoint(why)
            self._server.drain(why)
        self._stop_server()
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.stop()
        engine, self._engine = self._engine, None
        if engine is not None:
            if save:
                try:
                    path = engine.save(only_if_changed=True)
                    if path:
                        self.get_logger().info(f"{why}: pool saved to {path}")
                except Exception as e:
                    self.get_logger().error(f"{why}: saving the pool failed: {type(e).__name__}: {e}")
            try:
                engine.unload()
            except Exception as e:
                self.get_logger().error(f"{why}: unloading the engine failed: {type(e).__name__}: {e}")
        self._wait_for_service_replies(why)
        self._destroy_entities()
        self._monitor = None
        self._thermal = health.ThermalState()

    def checkpoint(self, why: str) -> str | None:
        """Save the pool now if it changed (does not wait for a running generation); never raises."""
        checkpointer, server = self._checkpointer, self._server
        if checkpointer is None:
            return None
        t0 = time.monotonic()
        path = checkpointer.checkpoint(why)
        if path:
            waiting = server.inflight if server is not None else 0
            self.get_logger().info(f"{why}: pool checkpointed to {path} in {time.monotonic() - t0:.2f} s"
                                   + (f", before waiting for {waiting} request(s) in flight" if waiting else ""))
        return path

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def _wait_for_service_replies(self, why: str) -> None:
        """rclpy sends a service reply after the callback returns: destroying the service before that
        would lose the reply (InvalidHandle in the executor). Wait for running callbacks, then a grace."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with self._calls:
            waited = self._service_calls > 0
            while self._service_calls and time.monotonic() < deadline:
                self._calls.wait(timeout=0.2)
            if self._service_calls:
                self.get_logger().warning(f"{why}: {self._service_calls} service call(s) still running")
        if waited:
            time.sleep(0.2)

    # ------------------------------------------------------------------ entities
    def _create_entities(self) -> None:
        """Publishers, at configure. The request entities come at the first activate."""
        # A plain publisher: refusals ("node is not active") must reach topic clients while inactive too.
        self._pub_responses = self.create_publisher(QueryResponse, "~/responses", RESPONSE_QOS)
        self._pub_stats = self.create_lifecycle_publisher(CacheStats, "~/cache_stats", 10)
        self._pub_thermal = self.create_lifecycle_publisher(ThermalStatus, "~/thermal", 10)
        self._pub_diag = self.create_lifecycle_publisher(DiagnosticArray, "/diagnostics", 10)
        self._pub_map = self.create_lifecycle_publisher(
            MarkerArray, "~/cache_map", QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL))

    def _create_request_entities(self) -> None:
        """Query service and request subscription, at the first activate: a client that waits for the
        service (or a subscription match) is then never answered "not active" by a node that is merely
        configuring. They stay through deactivate, answering refusals, until cleanup."""
        if self._srv is None:
            self._srv = self.create_service(Query, "~/query", self._on_query_service, qos_profile=REQUEST_QOS,
                                            callback_group=self._matching_group)
        if self._embed_srv is None:
            self._embed_srv = self.create_service(Embed, "~/embed", self._on_embed_service, qos_profile=REQUEST_QOS,
                                                  callback_group=self._matching_group)
        if self._action is None:
            self._action = ActionServer(self, Generate, "~/generate", execute_callback=self._on_goal,
                                        goal_callback=lambda goal: GoalResponse.ACCEPT,
                                        cancel_callback=lambda goal_handle: CancelResponse.ACCEPT,
                                        goal_service_qos_profile=REQUEST_QOS, result_service_qos_profile=REQUEST_QOS,
                                        cancel_service_qos_profile=REQUEST_QOS, callback_group=self._matching_group,
                                        result_timeout=GOAL_RESULT_KEEP_S)
        if self._sub is None:
            self._sub = self.create_subscription(
                QueryRequestMsg, "~/requests", self._on_request_msg, REQUEST_QOS, callback_group=self._matching_group)

    def _destroy_entities(self) -> None:
        with self._scope_pubs_lock:
            pubs, self._scope_pubs = list(self._scope_pubs.values()), {}
        for pub in pubs:
            try:
                self.destroy_publisher(pub)
            except Exception as e:
                self.get_logger().warning(f"destroying a per-scope responses publisher: {e}")
        for attr in ("_srv", "_embed_srv", "_action", "_sub", "_pub_responses", "_pub_stats", "_pub_thermal", "_pub_diag",
                     "_pub_map"):
            ent = getattr(self, attr)
            if ent is None:
                continue
            setattr(self, attr, None)
            try:
                if attr in ("_srv", "_embed_srv"):
                    self.destroy_service(ent)
                elif attr == "_action":
                    ent.destroy()
                elif attr == "_sub":
                    self.destroy_subscription(ent)
                elif attr == "_pub_responses":
                    self.destroy_publisher(ent)
                else:
                    self.destroy_lifecycle_publisher(ent)
            except Exception as e:
                self.get_logger().warning(f"destroying {attr[1:]}: {e}")

    def _destroy_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            try:
                timer.cancel()
                self.destroy_timer(timer)
            except Exception:
                pass

    # ---------------------------------------------------------- live parameters
    def _apply_live(self, settings: Settings, names: set[str]) -> None:
        """Live parameter change, already validated (ParameterGate): the engine owns the settings, the
        thermal monitor and the request server take their part."""
        engine = self._engine
        if engine is None:  # configure (or cleanup) in progress: the engine would miss the change
            raise SettingError(f"node is {self.state_label()}; retry once the transition is over")
        if names & {"thermal_warn_c", "thermal_critical_c", "thermal_hysteresis_c"} and self._monitor is not None:
            try:
                self._monitor.set_thresholds(warn_c=settings.thermal_warn_c, critical_c=settings.thermal_critical_c,
                                             hysteresis_c=settings.thermal_hysteresis_c)
            except ValueError as e:
                raise SettingError(str(e)) from None
        engine.update_settings(settings)  # raises SettingError
        if self._server is not None:
            self._server.set_queue_limit(settings.queue_limit)
            self._server.set_max_batch(settings.max_batch)

    # ------------------------------------------------------------ request path
    @contextlib.contextmanager
    def _service_call(self):
        """A service or goal callback in progress: deactivate and cleanup wait for these to finish."""
        with self._calls:
            self._service_calls += 1
        try:
            yield
        finally:
            with self._calls:
                self._service_calls -= 1
                self._calls.notify_all()

    def _answer(self, what: str, make_request, poll_s: float = 1.0, **submit) -> QueryResult:
        """One request through the request server, waited for; a refusal or a fault as a failed result."""
        try:
            req = make_request()
            server = self._server
            if server is None:
                return QueryResult.failure(not_active_error(self.state_label()))
            return server.wait(server.submit(req, **submit), poll_s=poll_s)
        except Exception as e:
            self.get_logger().error(f"{what}: {type(e).__name__}: {e}")
            return QueryResult.failure(internal_error(e))

    def _on_query_service(self, request: Query.Request, response: Query.Response) -> Query.Response:
        with self._service_call():
            result = self._answer("query service", lambda: _request_from(request))
        return _fill_result(response, result)

    def _on_request_msg(self, msg: QueryRequestMsg) -> None:
        try:
            req = _request_from(msg, msg.request_id)
            server, engine, scope = self._server, self._engine, req.cache_scope
            if server is None:
                self._publish_response(QueryResult.failure(not_active_error(self.state_label()), req.request_id), scope)
            elif engine is not None and engine.settings.responses_per_scope and self.scope_topic(scope) is None:
                self._publish_response(QueryResult.failure(
                    f"cache_scope {scope[:80]!r} cannot name a topic: with responses_per_scope, a scope must be a "
                    "ROS name (letters, digits, _ and /, no part starting with a digit)", req.request_id), scope)
            else:
                server.submit(req, lambda r: self._publish_response(r, scope), unique_id=True)
        except Exception as e:
            self.get_logger().error(f"request topic: {type(e).__name__}: {e}")
            self._publish_response(QueryResult.failure(internal_error(e), getattr(msg, "request_id", "")),
                                   getattr(msg, "cache_scope", ""))

    def _on_goal(self, goal_handle) -> Generate.Result:
        """One goal of ~/generate: through the same admission as the service; feedback as the answer grows;
        cancel ends it within one decode pass (or at once while it waits in the queue). A refusal or a bad
        goal is aborted with the reason in the result's error."""
        with self._service_call():
            result = self._answer(
                "generate action",
                lambda: _request_from(goal_handle.request, "goal-" + bytes(goal_handle.goal_id.uuid).hex()[:8]),
                poll_s=GOAL_POLL_S, on_progress=lambda p: self._send_feedback(goal_handle, p),
                should_stop=lambda: goal_handle.is_cancel_requested)
        try:
            if result.stop_reason == "cancel" and goal_handle.is_cancel_requested:
                goal_handle.canceled()
            elif result.success:
                goal_handle.succeed()
            else:
                goal_handle.abort()
        except Exception as e:  # the goal may already be gone (node shutting down)
            self.get_logger().warning(f"generate action: ending goal: {type(e).__name__}: {e}")
        return _fill_result(Generate.Result(), result)

    def _send_feedback(self, goal_handle, p: Progress) -> None:
        goal_handle.publish_feedback(Generate.Feedback(text=p.text, generated_tokens=_u32(p.generated_tokens),
                                                       cache_result=int(p.cache_result)))

    def _on_embed_service(self, request: Embed.Request, response: Embed.Response) -> Embed.Response:
        with self._service_call():
            try:
                engine = self._engine
                if engine is None or self.state_label() != "active":
                    response.success, response.error = False, not_active_error(self.state_label())
                    return response
                try:
                    vectors = engine.embed(list(request.texts))
                except ValueError as e:
                    response.success, response.error = False, str(e)
                    return response
                response.success = True
                response.dim = _u32(vectors.shape[1])
                response.vectors = vectors.reshape(-1).astype("float32").tolist()
            except Exception as e:
                self.get_logger().error(f"embed service: {type(e).__name__}: {e}")
                response.success, response.error = False, internal_error(e)
        return response

    def _responses_publisher(self, scope: str):
        """The shared ~/responses, or with responses_per_scope ~/responses/<scope> (created on first use).
        A scope that is no valid ROS name part (it holds '.', ':' or '-', or a part starts with a digit)
        gets the shared topic; its request was refused (see _on_request_msg), so only an error goes there."""
        engine = self._engine
        if engine is None or not engine.settings.responses_per_scope or self._pub_responses is None:
            return self._pub_responses
        topic = self.scope_topic(scope)
        if topic is None:
            return self._pub_responses
        with self._scope_pubs_lock:
            pub = self._scope_pubs.get(topic)
            if pub is None:
                pub = self.create_publisher(QueryResponse, topic, RESPONSE_QOS)
                self._scope_pubs[topic] = pub
            return pub

    def scope_topic(self, scope: str) -> str | None:
        """'/simllm_node/responses/kiosk_3' for scope 'kiosk_3' ('' -> .../default); None if not a valid name."""
        from rclpy.validate_full_topic_name import validate_full_topic_name
        topic = f"{self.get_fully_qualified_name()}/responses/{scope or 'default'}"
        try:
            validate_full_topic_name(topic)
        except Exception:
            return None
        return topic

    def _publish_response(self, result: QueryResult, scope: str = "") -> None:
        pub = self._responses_publisher(scope)
        if pub is None:
            self.get_logger().warning(f"request {result.request_id!r}: no response publisher (node cleaned up)")
            return
        out = _fill_result(QueryResponse(), result)
        out.request_id = str(result.request_id or "")
        pub.publish(out)

    # ---------------------------------------------------------------- telemetry
    def _read_thermal(self) -> ThermalReading | None:
        monitor, engine, server = self._monitor, self._engine, self._server
        if monitor is None:
            return None
        reading = monitor.read()
        reason = monitor.explain(reading)
        previous = self._thermal.level
        self._thermal = health.ThermalState(reading.level, reason)
        if server is not None:
            server.set_overheated(reason if reading.level >= ThermalLevel.CRITICAL else None)
        if reading.level != previous or reading.level_changed:
            if engine is not None:
                engine.set_thermal_level(reading.level)
            msg = f"thermal level {previous.name} -> {reading.level.name}" + (f": {reason}" if reason else "")
            if reading.level > previous:
                self.get_logger().warning(msg)
            else:
                self.get_logger().info(msg)
        return reading

    def _on_telemetry(self) -> None:
        engine, server = self._engine, self._server
        if engine is None:
            return
        now = self.get_clock().now().to_msg()
        reading = stats = None
        try:
            reading = self._read_thermal()
            if reading is not None:
                self._publish_thermal(reading, now)
        except Exception as e:
            self.get_logger().error(f"telemetry (thermal): {type(e).__name__}: {e}")
        try:
            stats = engine.stats(queue_depth=server.queue_depth if server is not None else 0)
            self._publish_stats(stats, now)
        except Exception as e:
            self.get_logger().error(f"telemetry (cache_stats): {type(e).__name__}: {e}")
        try:
            self._publish_diagnostics(engine, stats, reading, now)
        except Exception as e:
            self.get_logger().error(f"telemetry (diagnostics): {type(e).__name__}: {e}")
        try:
            self._publish_cache_map(cache_map.spheres(engine.entries(), salt=self._map_salt), now,
                                    engine.settings.cache_map_frame)
        except Exception as e:
            self.get_logger().error(f"telemetry (cache_map): {type(e).__name__}: {e}")

    def _publish_thermal(self, r: ThermalReading, stamp) -> None:
        if self._pub_thermal is None:
            return
        m = ThermalStatus()
        m.stamp = stamp
        m.zone_names = [z.name for z in r.zones]
        m.temperatures_c = [float(z.temp_c) if z.online else math.nan for z in r.zones]
        m.zone_online = [bool(z.online) for z in r.zones]
        m.hottest_zone = r.hottest_name
        m.hottest_c = float(r.hottest_c)
        m.throttle_state = int(r.level)
        m.warn_c = float(self._monitor.warn_c) if self._monitor else math.nan
        m.critical_c = float(self._monitor.critical_c) if self._monitor else math.nan
        self._pub_thermal.publish(m)

    def _publish_stats(self, stats: dict, stamp) -> None:
        if self._pub_stats is None:
            return
        m = CacheStats()
        m.stamp = stamp
        for field, ftype in CacheStats.get_fields_and_field_types().items():
            if field == "stamp" or field not in stats:
                continue
            v = stats[field]
            if ftype == "uint32":
                v = _u32(v)
            elif ftype == "uint64":
                v = _u64(v)
            else:
                v = float(v)
            setattr(m, field, v)
        self._pub_stats.publish(m)

    def _publish_diagnostics(self, engine: Engine, stats: dict | None, reading: ThermalReading | None,
                             stamp) -> None:
        if self._pub_diag is None:
            return
        server = self._server
        recent = self._health_window.update(time.monotonic(), stats) if stats is not None else None
        h = health.assess(stats, self._thermal, recent, ttft_warn_ms=engine.settings.ttft_warn_ms,
                          queue_limit=server.queue_limit if server is not None else engine.settings.queue_limit,
                          state=self.state_label(), reading=reading,
                          no_data_level=health.HealthLevel.ERROR if engine.settings.thermal_no_data_level == "error"
                          else health.HealthLevel.WARN,
                          lossless=engine.backend.exact_chunking if engine.backend is not None else None)
        s = engine.settings
        st = DiagnosticStatus(level=bytes([int(h.level)]), name=diagnostic_name(self.get_fully_qualified_name()),
                              message=h.message, hardware_id=s.hardware_id or socket.gethostname())
        st.values = [KeyValue(key=k, value=v) for k, v in h.values] + [KeyValue(key="model", value=str(s.model))]
        b = engine.backend
        if b is not None:  # what dtype / weight_bits "auto" chose on this machine
            st.values.append(KeyValue(key="precision", value=f"{b.dtype_name}, {b.weight_bits}-bit weights"))
            # the arithmetic by digest and kernel contract: two nodes with one digest compute the same bits
            st.values.append(KeyValue(key="numerics", value=f"{getattr(b, 'numerics', '')} ({NUMERICS_CONTRACT})"))
            # which attention computes the model's passes (kernel, torch, transformers): the fast path or not
            st.values.append(KeyValue(key="attention", value=b.attention_kind))
            if b.attention_arithmetic:  # and on what: amx tiles or vector code
                st.values.append(KeyValue(key="attention_arithmetic", value=b.attention_arithmetic))
            if b.int4_kind:  # which kernel computes the 4-bit products (amx, vector, aten)
                st.values.append(KeyValue(key="int4_products", value=b.int4_kind))
            if b.layers_kind:  # whether a pass's layers run in one C call (c) or from Python
                st.values.append(KeyValue(key="layers", value=b.layers_kind))
        arr = DiagnosticArray(status=[st])
        arr.header.stamp = stamp
        self._pub_diag.publish(arr)

    def _publish_cache_map(self, spheres: list[cache_map.Sphere], stamp, frame: str) -> None:
        if self._pub_map is None:
            return
        arr = MarkerArray()
        frame = namespaced_frame(frame, self.get_namespace())
        clear = Marker(action=Marker.DELETEALL)
        clear.header.frame_id = frame
        clear.header.stamp = stamp
        arr.markers.append(clear)
        for i, s in enumerate(spheres):
            m = Marker(type=Marker.SPHERE, action=Marker.ADD, id=i, ns=s.namespace)
            m.header.frame_id = frame
            m.header.stamp = stamp
            m.pose.position = Point(x=s.x, y=s.y, z=s.z)
            m.pose.orientation.w = 1.0
            m.scale.x = m.scale.y = m.scale.z = s.diameter
            m.color = ColorRGBA(r=s.rgba[0], g=s.rgba[1], b=s.rgba[2], a=s.rgba[3])
            arr.markers.append(m)
        self._pub_map.publish(arr)


def make_executor(node: SimLLMNode | None = None, context=None) -> MultiThreadedExecutor:
    """A MultiThreadedExecutor with enough threads for blocked service callbacks plus the other groups.

    Service callbacks hold an executor thread while they wait for their answer; with fewer threads
    than queue_limit + a few, extra requests wait in DDS instead of being refused as busy (they are
    still answered), and telemetry may lag under load.
    """
    limit = 8
    if node is not None:
        try:
            limit = int(node.get_parameter("queue_limit").value)
        except Exception:
            pass
    return MultiThreadedExecutor(num_threads=max(8, min(limit + 6, 64)), context=context)


__all__ = ["SimLLMNode", "make_executor", "NODE_NAME", "diagnostic_name", "namespaced_frame"]
