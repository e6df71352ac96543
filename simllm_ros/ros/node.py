"""The lifecycle node `simllm_node`: hosts the Engine and exposes it over ROS 2.

Transitions (one callback each, as in ros2/demos lifecycle_py):
  configure  : parameters -> Settings -> Engine.load() (model, embedder, pool restore, warm-up);
               creates the publishers.
               Any failure logs one clear line, releases everything and returns FAILURE.
  activate   : starts the telemetry timer, enables the lifecycle publishers, admits requests;
               the first activate creates the Query service and the request subscription.
  deactivate : refuses new requests, waits for the in-flight ones, keeps the pool.
  cleanup    : saves the pool, unloads the model, destroys the entities.
  shutdown   : the same from any state.

Request path (service `~/query` and topic `~/requests` -> `~/responses`):
  admission  : bounded queue (queue_limit, live); a full queue answers "busy: ..." at once,
               an inactive node "node is not active (state: ...)", a critical thermal level
               "overheated: ...". Every request is answered exactly once.
  matching   : Engine.prepare (validation + fingerprint) runs in the calling callback, which
               belongs to the reentrant "matching" callback group, so several requests are
               fingerprinted while another one generates.
  generation : one dedicated worker thread drains the queue through Engine.execute (the model
               runs one request at a time). It needs no executor thread, so service callbacks
               that block on their answer can never starve it.
The executor must be a MultiThreadedExecutor; `make_executor()` sizes one.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Callable

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import Point
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import ColorRGBA
from visualization_msgs.msg import Marker, MarkerArray

from simllm_ros.engine import Engine, EngineLoadError
from simllm_ros.msg import CacheStats, QueryRequest as QueryRequestMsg, QueryResponse, ThermalStatus
from simllm_ros.request import CacheResult, QueryRequest, QueryResult
from simllm_ros.ros.params import ParameterGate, declare_all, settings_from_node
from simllm_ros.settings import SettingError
from simllm_ros.srv import Query
from simllm_ros.thermal import ThermalLevel, ThermalMonitor, ThermalReading

NODE_NAME = "simllm_node"
DIAGNOSTIC_NAME = "simllm_ros: LLM service"
CACHE_MAP_FRAME = "simllm_cache"
DIAG_WINDOW_S = 30.0  # errors / busy rejections counted over this window
DRAIN_TIMEOUT_S = 300.0  # deactivate/cleanup wait at most this long for in-flight requests
MAX_MARKERS = 2000

_OK, _WARN, _ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR
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


class _Job:
    """One admitted request; finished exactly once."""

    __slots__ = ("req", "prepared", "result", "done", "on_done", "_finished")

    def __init__(self, req: QueryRequest, on_done: Callable[[QueryResult], None] | None):
        self.req = req
        self.prepared = None
        self.result: QueryResult | None = None
        self.done = threading.Event()
        self.on_done = on_done
        self._finished = False


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
    return msg


def _heat_colour(t: float) -> ColorRGBA:
    """0 -> cold blue, 1 -> hot red."""
    t = min(max(t, 0.0), 1.0)
    return ColorRGBA(r=t, g=0.25 * (1.0 - abs(2.0 * t - 1.0)), b=1.0 - t, a=0.85)


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
        self._settings = None
        self._monitor: ThermalMonitor | None = None

        # admission / generation state, all guarded by _cv
        self._cv = threading.Condition()
        self._active = False
        self._queue_limit = 8
        self._waiting = 0  # admitted, not yet picked up by the generation worker
        self._inflight = 0  # admitted, not yet answered
        self._service_calls = 0  # Query service callbacks still running (their reply is sent after they return)
        self._gen_queue: collections.deque[_Job] = collections.deque()
        self._gen_stop = False
        self._gen_thread: threading.Thread | None = None

        # thermal state shared with admission
        self._thermal_level = ThermalLevel.OK
        self._thermal_reason = ""
        self._last_reading: ThermalReading | None = None
        self._diag_history: collections.deque = collections.deque()  # (t, requests, errors, busy)

        self._matching_group = ReentrantCallbackGroup()
        self._telemetry_group = MutuallyExclusiveCallbackGroup()
        self._srv = None
        self._sub = None
        self._pub_responses = None
        self._pub_stats = None
        self._pub_thermal = None
        self._pub_diag = None
        self._pub_map = None
        self._timer = None

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
            self._settings = settings
            self._monitor = monitor
            self._queue_limit = int(settings.queue_limit)
            self._create_entities()
            self._start_generation()
            self._engine = engine
            rep = getattr(engine, "load_report", {}) or {}
            log.info(f"configured in {time.monotonic() - t0:.1f} s: restored {rep.get('restored', 0)} cached "
                     f"entries, {rep.get('warmup', 0)} warm-up requests")
        except Exception as e:
            kind = "" if isinstance(e, EngineLoadError) else f"{type(e).__name__}: "
            log.error(f"configure failed: {kind}{e}")
            self._engine = None
            self._stop_generation()
            self._destroy_entities()
            if engine is not None:
                try:
                    engine.unload()
                except Exception as e2:
                    log.warning(f"unload after failed configure: {e2}")
            self._settings = None
            self._monitor = None
            return TransitionCallbackReturn.FAILURE
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            ret = super().on_activate(state)  # enables the lifecycle publishers
            if ret != TransitionCallbackReturn.SUCCESS:
                return ret
            self._diag_history.clear()
            self._read_thermal()  # shed load from the start if already critical
            self._timer = self.create_timer(float(self._settings.telemetry_period_s), self._on_telemetry,
                                            callback_group=self._telemetry_group)
            with self._cv:
                self._active = True
            self._create_request_entities()
            self.get_logger().info("active: serving ~/query and ~/requests")
            return TransitionCallbackReturn.SUCCESS
        except Exception as e:
            self.get_logger().error(f"activate failed: {type(e).__name__}: {e}")
            return TransitionCallbackReturn.FAILURE

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        with self._cv:
            self._active = False
        self._drain("deactivate")
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
        """Refuse, drain, save, unload, destroy: safe from any state and idempotent."""
        with self._cv:
            self._active = False
        self._destroy_timer()
        if self._engine is not None or self._gen_thread is not None:
            self._drain(why)
        self._stop_generation()
        engine, self._engine = self._engine, None
        if engine is not None:
            if save:
                try:
                    path = engine.save()
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
        self._settings = None
        self._monitor = None
        with self._cv:
            self._thermal_level = ThermalLevel.OK
            self._thermal_reason = ""

    def _wait_for_service_replies(self, why: str) -> None:
        """rclpy sends a service reply after the callback returns: destroying the service before that
        would lose the reply (InvalidHandle in the executor). Wait for running callbacks, then a grace."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with self._cv:
            waited = self._service_calls > 0
            while self._service_calls and time.monotonic() < deadline:
                self._cv.wait(timeout=0.2)
            if self._service_calls:
                self.get_logger().warning(f"{why}: {self._service_calls} service call(s) still running")
        if waited:
            time.sleep(0.2)

    def _drain(self, why: str) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with self._cv:
            if self._inflight:
                self.get_logger().info(f"{why}: waiting for {self._inflight} in-flight request(s)")
            while self._inflight and time.monotonic() < deadline:
                self._cv.wait(timeout=0.5)
            if self._inflight:
                self.get_logger().warning(f"{why}: {self._inflight} request(s) still in flight after "
                                          f"{DRAIN_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------------ entities
    def _create_entities(self) -> None:
        """Publishers, at configure. The request entities come at the first activate."""
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        # A plain publisher: refusals ("node is not active") must reach topic clients while inactive too.
        self._pub_responses = self.create_publisher(QueryResponse, "~/responses", reliable)
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
            self._srv = self.create_service(Query, "~/query", self._on_query_service,
                                            callback_group=self._matching_group)
        if self._sub is None:
            self._sub = self.create_subscription(
                QueryRequestMsg, "~/requests", self._on_request_msg,
                QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE), callback_group=self._matching_group)

    def _destroy_entities(self) -> None:
        for attr in ("_srv", "_sub", "_pub_responses", "_pub_stats", "_pub_thermal", "_pub_diag", "_pub_map"):
            ent = getattr(self, attr)
            if ent is None:
                continue
            setattr(self, attr, None)
            try:
                if attr == "_srv":
                    self.destroy_service(ent)
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
    def _apply_live(self, changes: dict) -> None:
        engine = self._engine
        if engine is None:  # configure (or cleanup) in progress: the engine would miss the change
            raise SettingError(f"node is {self.state_label()}; retry once the transition is over")
        engine.apply_settings(changes)  # raises SettingError
        thermal = {k: changes[k] for k in ("thermal_warn_c", "thermal_critical_c", "thermal_hysteresis_c")
                   if k in changes}
        if thermal and self._monitor is not None:
            try:
                self._monitor.set_thresholds(warn_c=thermal.get("thermal_warn_c"),
                                             critical_c=thermal.get("thermal_critical_c"),
                                             hysteresis_c=thermal.get("thermal_hysteresis_c"))
            except ValueError as e:
                raise SettingError(str(e)) from None
        if self._settings is not None:
            self._settings = self._settings.replace(**changes)
        if "queue_limit" in changes:
            with self._cv:
                self._queue_limit = int(changes["queue_limit"])
                self._cv.notify_all()

    # ------------------------------------------------------------ request path
    def _admit(self, req: QueryRequest, on_done) -> _Job | QueryResult:
        engine = self._engine
        with self._cv:
            if not self._active or engine is None:
                return QueryResult.failure(f"node is not active (state: {self.state_label()})", req.request_id)
            if self._thermal_level >= ThermalLevel.CRITICAL:
                return QueryResult.failure(f"overheated: {self._thermal_reason}; shedding load, retry when cooler",
                                           req.request_id)
            if self._waiting >= self._queue_limit:
                waiting, limit = self._waiting, self._queue_limit
                busy = True
            else:
                busy = False
                self._waiting += 1
                self._inflight += 1
        if busy:
            try:
                engine.record_rejected_busy()
            except Exception:
                pass
            return QueryResult.failure(f"busy: {waiting} requests already waiting (queue_limit {limit}); retry later",
                                       req.request_id)
        return _Job(req, on_done)

    def _submit(self, req: QueryRequest, on_done=None) -> _Job | QueryResult:
        """Admit, fingerprint (in the caller's thread: the matching group) and queue for generation."""
        job = self._admit(req, on_done)
        if isinstance(job, QueryResult):
            return job
        try:
            prepared = self._engine.prepare(req) if self._engine is not None else \
                QueryResult.failure("node is not active (state: unconfigured)", req.request_id)
        except Exception as e:
            self.get_logger().error(f"request {req.request_id!r}: prepare failed: {type(e).__name__}: {e}")
            prepared = QueryResult.failure(f"internal error: {type(e).__name__}: {e}", req.request_id)
        if isinstance(prepared, QueryResult):
            with self._cv:
                self._waiting -= 1
            self._finish(job, prepared)
            return job
        job.prepared = prepared
        with self._cv:
            if self._gen_thread is None or self._gen_stop:
                self._waiting -= 1
                orphan = True
            else:
                self._gen_queue.append(job)
                self._cv.notify_all()
                orphan = False
        if orphan:
            self._finish(job, QueryResult.failure(f"node is not active (state: {self.state_label()})",
                                                  req.request_id))
        return job

    def _finish(self, job: _Job, result: QueryResult) -> None:
        with self._cv:
            if job._finished:
                return
            job._finished = True
            self._inflight -= 1
            self._cv.notify_all()
        result.request_id = job.req.request_id
        job.result = result
        job.done.set()
        if job.on_done is not None:
            try:
                job.on_done(result)
            except Exception as e:
                self.get_logger().error(f"request {job.req.request_id!r}: answering failed: {e}")

    def _start_generation(self) -> None:
        with self._cv:
            self._gen_stop = False
            self._gen_queue.clear()
        self._gen_thread = threading.Thread(target=self._generation_loop, name="simllm-generation", daemon=True)
        self._gen_thread.start()

    def _stop_generation(self) -> None:
        thread = self._gen_thread
        if thread is None:
            return
        with self._cv:
            self._gen_stop = True
            self._cv.notify_all()
        thread.join(timeout=DRAIN_TIMEOUT_S)
        if thread.is_alive():
            self.get_logger().error("generation worker did not stop")
        self._gen_thread = None

    def _generation_loop(self) -> None:
        while True:
            with self._cv:
                while not self._gen_queue and not self._gen_stop:
                    engine = self._engine
                    if engine is not None and self._active and engine.has_idle_work():
                        break  # nothing waits: use the time for deferred exact prefills
                    self._cv.wait(timeout=1.0)
                if self._gen_stop and not self._gen_queue:
                    return
                job = self._gen_queue.popleft() if self._gen_queue else None
                if job is not None:
                    self._waiting -= 1
            if job is None:
                try:
                    engine.idle_work()
                except Exception as e:
                    self.get_logger().error(f"idle work failed: {type(e).__name__}: {e}")
                continue
            try:
                engine = self._engine
                if engine is None:
                    result = QueryResult.failure("node is not active (state: unconfigured)")
                else:
                    result = engine.execute(job.prepared)
            except Exception as e:
                self.get_logger().error(f"request {job.req.request_id!r}: generation failed: {type(e).__name__}: {e}")
                result = QueryResult.failure(f"internal error: {type(e).__name__}: {e}")
            self._finish(job, result)

    def _on_query_service(self, request: Query.Request, response: Query.Response) -> Query.Response:
        with self._cv:
            self._service_calls += 1
        try:
            return self._answer_query_service(request, response)
        finally:
            with self._cv:
                self._service_calls -= 1
                self._cv.notify_all()

    def _answer_query_service(self, request: Query.Request, response: Query.Response) -> Query.Response:
        try:
            req = QueryRequest(prompt=request.prompt, context=request.context, cache_scope=request.cache_scope,
                               max_new_tokens=int(request.max_new_tokens),
                               allow_approximate=bool(request.allow_approximate))
            job = self._submit(req)
            if isinstance(job, QueryResult):
                result = job
            else:
                while not job.done.wait(timeout=1.0):
                    if self._gen_thread is None and not job.done.is_set():
                        self._finish(job, QueryResult.failure("node stopped before answering"))
                result = job.result
        except Exception as e:
            self.get_logger().error(f"query service: {type(e).__name__}: {e}")
            result = QueryResult.failure(f"internal error: {type(e).__name__}: {e}")
        return _fill_result(response, result)

    def _on_request_msg(self, msg: QueryRequestMsg) -> None:
        try:
            req = QueryRequest(prompt=msg.prompt, context=msg.context, cache_scope=msg.cache_scope,
                               max_new_tokens=int(msg.max_new_tokens), allow_approximate=bool(msg.allow_approximate),
                               request_id=msg.request_id)
            job = self._submit(req, on_done=self._publish_response)
            if isinstance(job, QueryResult):
                self._publish_response(job)
        except Exception as e:
            self.get_logger().error(f"request topic: {type(e).__name__}: {e}")
            self._publish_response(QueryResult.failure(f"internal error: {type(e).__name__}: {e}",
                                                       getattr(msg, "request_id", "")))

    def _publish_response(self, result: QueryResult) -> None:
        pub = self._pub_responses
        if pub is None:
            self.get_logger().warning(f"request {result.request_id!r}: no response publisher (node cleaned up)")
            return
        out = _fill_result(QueryResponse(), result)
        out.request_id = str(result.request_id or "")
        pub.publish(out)

    # ---------------------------------------------------------------- telemetry
    def _read_thermal(self) -> ThermalReading | None:
        monitor, engine = self._monitor, self._engine
        if monitor is None:
            return None
        reading = monitor.read()
        if reading.level == ThermalLevel.OK:
            reason = ""
        else:
            limit = monitor.critical_c if reading.level == ThermalLevel.CRITICAL else monitor.warn_c
            reason = (f"hottest zone {reading.hottest_name} at {reading.hottest_c:.1f} C "
                      f"(threshold {limit:.1f} C)")
        with self._cv:
            previous = self._thermal_level
            self._thermal_level = reading.level
            self._thermal_reason = reason
            self._last_reading = reading
        if reading.level != previous or reading.level_changed:
            if engine is not None:
                engine.set_thermal_level(int(reading.level))
            msg = f"thermal level {previous.name} -> {reading.level.name}" + (f": {reason}" if reason else "")
            if reading.level > previous:
                self.get_logger().warning(msg)
            else:
                self.get_logger().info(msg)
        return reading

    def _on_telemetry(self) -> None:
        engine = self._engine
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
            with self._cv:
                depth = self._waiting
            stats = engine.stats(queue_depth=depth)
            self._publish_stats(stats, now)
        except Exception as e:
            self.get_logger().error(f"telemetry (cache_stats): {type(e).__name__}: {e}")
        try:
            self._publish_diagnostics(stats, reading, now)
        except Exception as e:
            self.get_logger().error(f"telemetry (diagnostics): {type(e).__name__}: {e}")
        try:
            self._publish_cache_map(engine.cache_map(), now)
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

    def _diagnose(self, stats: dict | None, reading: ThermalReading | None) -> tuple[bytes, str]:
        level, reasons = _OK, []

        def raise_to(lvl):
            nonlocal level
            if lvl[0] > level[0]:
                level = lvl

        with self._cv:
            tl, treason = self._thermal_level, self._thermal_reason
        if tl == ThermalLevel.CRITICAL:
            raise_to(_ERROR)
            reasons.append(f"overheated, shedding load: {treason}")
        elif tl == ThermalLevel.WARN:
            raise_to(_WARN)
            reasons.append(f"running hot, shorter answers: {treason}")
        if stats is None:
            raise_to(_ERROR)
            reasons.append("cache statistics unavailable")
            return level, "; ".join(reasons)
        if float(stats.get("budget_use", 0.0)) > 0.98:
            raise_to(_WARN)
            reasons.append(f"KV pool nearly full ({100 * float(stats['budget_use']):.0f}% of budget)")
        t = time.monotonic()
        hist = self._diag_history
        hist.append((t, int(stats.get("requests_total", 0)), int(stats.get("errors_total", 0)),
                     int(stats.get("rejected_busy_total", 0))))
        while len(hist) > 1 and hist[0][0] < t - DIAG_WINDOW_S:
            hist.popleft()
        _, r0, e0, b0 = hist[0]
        _, r1, e1, b1 = hist[-1]
        d_req, d_err, d_busy = r1 - r0, e1 - e0, b1 - b0
        if d_err > 0 and d_req > 0:
            rate = d_err / d_req
            if rate >= 0.5 and d_err >= 3:
                raise_to(_ERROR)
                reasons.append(f"{d_err} of {d_req} requests failed in the last {DIAG_WINDOW_S:.0f} s")
            elif rate > 0.1 and d_err >= 2:  # one bad request is noise
                raise_to(_WARN)
                reasons.append(f"{d_err} of {d_req} requests failed in the last {DIAG_WINDOW_S:.0f} s")
        if d_busy > 0:
            raise_to(_WARN)
            reasons.append(f"{d_busy} requests refused as busy in the last {DIAG_WINDOW_S:.0f} s "
                           f"(queue_limit {self._queue_limit})")
        p95 = max(float(stats.get("ttft_hit_p95_ms", 0.0)), float(stats.get("ttft_miss_p95_ms", 0.0)))
        target = float(self.get_parameter("ttft_warn_ms").value)
        if p95 > target:
            raise_to(_WARN)
            reasons.append(f"p95 time to first token {p95:.0f} ms above ttft_warn_ms {target:.0f} ms")
        return level, "; ".join(reasons) if reasons else "ok"

    def _publish_diagnostics(self, stats: dict | None, reading: ThermalReading | None, stamp) -> None:
        if self._pub_diag is None:
            return
        level, message = self._diagnose(stats, reading)
        st = DiagnosticStatus(level=level, name=DIAGNOSTIC_NAME, message=message,
                              hardware_id=str(self._settings.model if self._settings else ""))
        kv = [("state", self.state_label())]
        if stats is not None:
            kv += [(k, stats.get(k, 0)) for k in (
                "entries", "bytes_used", "bytes_budget", "budget_use", "hit_rate_exact_recent",
                "hit_rate_semantic_recent", "hit_rate_answer_recent", "hit_rate_any_recent", "hit_rate_any_total",
                "requests_total", "errors_total", "rejected_busy_total", "queue_depth", "evictions_total",
                "ttft_hit_mean_ms", "ttft_hit_p95_ms", "ttft_miss_mean_ms", "ttft_miss_p95_ms")]
        with self._cv:
            kv.append(("queue_limit", self._queue_limit))
            tl = self._thermal_level
        kv.append(("thermal_level", tl.name))
        if reading is not None:
            kv.append(("hottest_zone", reading.hottest_name))
            kv.append(("hottest_c", "nan" if math.isnan(reading.hottest_c) else f"{reading.hottest_c:.1f}"))

        def fmt(v):
            return f"{v:.4g}" if isinstance(v, float) else str(v)

        st.values = [KeyValue(key=k, value=fmt(v)) for k, v in kv]
        arr = DiagnosticArray(status=[st])
        arr.header.stamp = stamp
        self._pub_diag.publish(arr)

    def _publish_cache_map(self, entries: list[dict], stamp) -> None:
        if self._pub_map is None:
            return
        arr = MarkerArray()
        clear = Marker(action=Marker.DELETEALL)
        clear.header.frame_id = CACHE_MAP_FRAME
        clear.header.stamp = stamp
        arr.markers.append(clear)
        entries = entries[:MAX_MARKERS]
        if entries:
            max_b = max(float(e.get("bytes", 0)) for e in entries) or 1.0
            max_h = max(int(e.get("hits", 0)) for e in entries)
            for i, e in enumerate(entries):
                m = Marker(type=Marker.SPHERE, action=Marker.ADD, id=i, ns=str(e.get("scope", "") or "default"))
                m.header.frame_id = CACHE_MAP_FRAME
                m.header.stamp = stamp
                m.pose.position = Point(x=float(e["x"]), y=float(e["y"]), z=float(e["z"]))
                m.pose.orientation.w = 1.0
                d = 0.03 + 0.2 * math.sqrt(max(float(e.get("bytes", 0)), 0.0) / max_b)
                m.scale.x = m.scale.y = m.scale.z = d
                h = int(e.get("hits", 0))
                m.color = _heat_colour(math.log1p(h) / math.log1p(max_h) if max_h > 0 else 0.0)
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


__all__ = ["SimLLMNode", "make_executor", "NODE_NAME", "DIAGNOSTIC_NAME", "CACHE_MAP_FRAME"]
