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

Requests (service `~/query`, topic `~/requests` -> `~/responses`, action `~/generate`) reach
ros.endpoints.RequestEndpoints, which hands them to request_server.RequestServer: it admits, queues and
answers each exactly once; its prepare step (validation, schema compile, fingerprint) runs in the calling
callback, which belongs to a reentrant group, so several requests are fingerprinted while another one
generates on the server's own worker thread. The action streams the answer so far as feedback and
cancels through the job's should_stop. `~/embed` runs the embedder directly (no queue: it does not
touch the model).

The decisions are the core's, the node only applies and publishes them: thermal.ThermalPolicy (shed
load when critical, act on level changes), health.ServiceHealth (/diagnostics, named after the node's
full name), cache_map.spheres (~/cache_map); ros.messages copies them into messages. The executor must
be a MultiThreadedExecutor; `make_executor()` sizes one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable

from diagnostic_msgs.msg import DiagnosticArray, KeyValue
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecyclePublisher, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile
from rclpy.timer import Timer
from std_msgs.msg import String
from visualization_msgs.msg import MarkerArray

from simllm_ros.cache import cache_map
from simllm_ros.serving import health
from simllm_ros.cache.cache_map import namespaced_frame
from simllm_ros.cache.checkpoint import Checkpointer
from simllm_ros.serving.engine import Engine, EngineLoadError
from simllm_ros.msg import CacheStats, ThermalStatus
from simllm_ros.serving.request_server import RequestServer
from simllm_ros.ros import messages
from simllm_ros.ros.endpoints import RequestEndpoints
from simllm_ros.ros.tool_executor import ToolRunner
from simllm_ros.serving.tool_call_reuse import CallReuse
from simllm_ros.model.tool_call_formats import describe as describe_format
from simllm_ros.serving.tool_schemas import ToolError
from simllm_ros.serving.toolbox import load_tools
from simllm_ros.ros.params import ParameterGate, check_undeclared, declare_all, settings_from_node
from simllm_ros.settings import SettingError, Settings
from simllm_ros.serving.thermal import ThermalMonitor, ThermalPolicy, ThermalReading, ThermalState

NODE_NAME = "simllm_node"
DIAGNOSTIC_TASK = "LLM service"  # the status is "<node's full name without the leading slash>: LLM service"


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


def diagnostic_name(full_name: str) -> str:
    """ROS convention (diagnostic_updater): '<node's full name without the leading slash>: <task>'."""
    return f"{full_name.lstrip('/')}: {DIAGNOSTIC_TASK}"


LOAD_PROGRESS_QOS = QoSProfile(depth=20, durability=DurabilityPolicy.TRANSIENT_LOCAL)


class SimLLMNode(LifecycleNode):
    def __init__(self, node_name: str = NODE_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        declare_all(self)  # raises SettingError for a bad value in the params file / overrides
        self.add_on_set_parameters_callback(ParameterGate(
            self, is_loaded=self._model_loaded, state_label=self.state_label,
            apply_live=self._apply_live))

        self.progress: Callable[[str], None] | None = None  # extra sink for load progress (the CLI prints)
        # configure's progress as it happens (a first load converts and packs a GGUF for a minute or more): a plain
        # publisher, not a lifecycle one, since it speaks while the node is between states; late subscribers get
        # the last lines
        self._pub_load = self.create_publisher(String, "~/load_progress", LOAD_PROGRESS_QOS)
        self._py_log = logging.getLogger(f"simllm_ros.node.{id(self):x}")
        self._py_log.setLevel(logging.INFO)
        self._log_handler = _RosLogHandler(self.get_logger())
        self._py_log.addHandler(self._log_handler)

        self._engine: Engine | None = None
        self._server: RequestServer | None = None
        self._checkpointer: Checkpointer | None = None
        self._thermal: ThermalPolicy | None = None
        self._health = health.ServiceHealth()
        self._map_salt = os.urandom(16)  # cache_map namespaces are scope tags, never scope names
        self._tools: ToolRunner | None = None  # the tools file's tools, from configure to cleanup
        self._endpoints = RequestEndpoints(self, server=lambda: self._server, engine=lambda: self._engine,
                                           state=self.state_label, tools=lambda: self._tools)
        self._telemetry_group = MutuallyExclusiveCallbackGroup()
        # configure to cleanup (the messages are generated, untyped)
        self._pub_stats: LifecyclePublisher[Any] | None = None
        self._pub_thermal: LifecyclePublisher[Any] | None = None
        self._pub_diag: LifecyclePublisher[Any] | None = None
        self._pub_map: LifecyclePublisher[Any] | None = None
        self._timer: Timer | None = None  # activate to deactivate

    def _check_undeclared_parameters(self, parameter_list) -> None:
        check_undeclared(self, parameter_list)

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
            toolbox = load_tools(settings.tools) if settings.tools else None  # a bad file fails here, before the load
            engine = Engine(settings, log=self._py_log)
            t0 = time.monotonic()
            engine.load(progress=self._progress)
            self._thermal = ThermalPolicy(monitor)
            self._server = RequestServer(engine, state=self.state_label, log=self._py_log)
            self._create_entities()
            if toolbox is not None:
                fmt, why = engine.loaded_backend().tool_format
                traits = engine.loaded_backend().tool_traits
                self._tools = ToolRunner(self, toolbox, execute=lambda: bool(engine.settings.tools_execute),
                                         reuse=CallReuse(engine, toolbox), tool_format=fmt, traits=traits,
                                         max_calls=lambda: int(engine.settings.tool_max_calls))
                listed = ", ".join(f"{n} ({t.kind} {t.ros_name}{', executable' if t.executable else ''})"
                                   for n, t in toolbox.tools.items())
                log.info(f"tools: {listed or 'none'}; tools_execute={settings.tools_execute}; answer format: "
                         f"{describe_format(fmt)}: {why}; {traits.why}")
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
            kind = "tools: " if isinstance(e, ToolError) else "" if isinstance(e, EngineLoadError) else \
                f"{type(e).__name__}: "
            log.error(f"configure failed: {kind}{e}")
            self._engine = None
            self._stop_server()
            self._destroy_entities()
            tools, self._tools = self._tools, None
            if tools is not None:
                tools.destroy()
            if engine is not None:
                try:
                    engine.unload()
                except Exception as e2:
                    log.warning(f"unload after failed configure: {e2}")
            self._thermal = None
            return TransitionCallbackReturn.FAILURE
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            ret = super().on_activate(state)  # enables the lifecycle publishers
            if ret != TransitionCallbackReturn.SUCCESS:
                return ret
            self._health.clear()
            engine, server = self._engine, self._server
            if engine is None or server is None:  # configure did not succeed
                raise RuntimeError("the node is not configured")
            self._read_thermal(self._thermal)  # shed load from the start if already critical
            self._timer = self.create_timer(float(engine.settings.telemetry_period_s), self._on_telemetry,
                                            callback_group=self._telemetry_group)
            server.open()
            self._endpoints.create()
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
        try:
            self._pub_load.publish(String(data=message))
        except Exception:  # a context shutting down: the log line above stands
            pass
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
        self._endpoints.wait_for_replies(why)
        self._destroy_entities()
        tools, self._tools = self._tools, None
        if tools is not None:
            tools.destroy()
        self._thermal = None

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

    # ------------------------------------------------------------------ entities
    def _create_entities(self) -> None:
        """Publishers, at configure. The request entities come at the first activate (RequestEndpoints)."""
        self._endpoints.create_responses()
        self._pub_stats = self.create_lifecycle_publisher(CacheStats, "~/cache_stats", 10)
        self._pub_thermal = self.create_lifecycle_publisher(ThermalStatus, "~/thermal", 10)
        self._pub_diag = self.create_lifecycle_publisher(DiagnosticArray, "/diagnostics", 10)
        self._pub_map = self.create_lifecycle_publisher(
            MarkerArray, "~/cache_map", QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL))

    def _destroy_entities(self) -> None:
        self._endpoints.destroy()
        for attr in ("_pub_stats", "_pub_thermal", "_pub_diag", "_pub_map"):
            pub = getattr(self, attr)
            if pub is None:
                continue
            setattr(self, attr, None)
            try:
                self.destroy_lifecycle_publisher(pub)
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
        engine, thermal = self._engine, self._thermal
        if engine is None:  # configure (or cleanup) in progress: the engine would miss the change
            raise SettingError(f"node is {self.state_label()}; retry once the transition is over")
        if names & {"thermal_warn_c", "thermal_critical_c", "thermal_hysteresis_c"} and thermal is not None:
            try:
                thermal.monitor.set_thresholds(warn_c=settings.thermal_warn_c, critical_c=settings.thermal_critical_c,
                                               hysteresis_c=settings.thermal_hysteresis_c)
            except ValueError as e:
                raise SettingError(str(e)) from None
        engine.update_settings(settings)  # raises SettingError
        if self._server is not None:
            self._server.set_queue_limit(settings.queue_limit)
            self._server.set_max_batch(settings.max_batch)

    def scope_topic(self, scope: str) -> str | None:
        """'/simllm_node/responses/kiosk_3' for scope 'kiosk_3' ('' -> .../default); None if not a valid name."""
        return self._endpoints.scope_topic(scope)

    # ---------------------------------------------------------------- telemetry
    def _read_thermal(self, thermal: ThermalPolicy | None) -> ThermalReading | None:
        """Apply the thermal policy: refuse requests while overheated, tell the engine and the log of a change."""
        engine, server = self._engine, self._server
        if thermal is None:
            return None
        reading, change = thermal.read()
        if server is not None:
            server.set_overheated(thermal.overheated)
        if change is not None:
            if engine is not None:
                engine.set_thermal_level(change.level)
            (self.get_logger().warning if change.rising else self.get_logger().info)(change.message)
        return reading

    @contextlib.contextmanager
    def _telemetry_part(self, what: str):
        """One topic of a telemetry tick: its fault is logged and the other topics still publish."""
        try:
            yield
        except Exception as e:
            self.get_logger().error(f"telemetry ({what}): {type(e).__name__}: {e}")

    def _on_telemetry(self) -> None:
        engine, server, thermal = self._engine, self._server, self._thermal
        if engine is None:
            return
        now = self.get_clock().now().to_msg()
        reading = stats = None
        with self._telemetry_part("thermal"):
            reading = self._read_thermal(thermal)
            if reading is not None and thermal is not None and self._pub_thermal is not None:
                self._pub_thermal.publish(messages.thermal_status(reading, thermal.monitor.warn_c,
                                                                  thermal.monitor.critical_c, now))
        with self._telemetry_part("cache_stats"):
            stats = {**engine.stats(queue_depth=server.queue_depth if server is not None else 0),
                     **engine.error_bound.totals(), **engine.energy_stats()}
            if self._pub_stats is not None:
                self._pub_stats.publish(messages.cache_stats(stats, now))
        with self._telemetry_part("diagnostics"):
            if self._pub_diag is not None:
                h = self._health.report(
                    time.monotonic(), stats, thermal.state if thermal is not None else ThermalState(), reading,
                    engine.settings, health.BackendFacts.of(engine.backend), state=self.state_label(),
                    queue_limit=server.queue_limit if server is not None else engine.settings.queue_limit,
                    fleet=engine.fleet.status() if engine.fleet is not None else None,
                    approx=engine.error_bound.summary(), energy=engine.energy.status())
                diag = messages.diagnostics(h, diagnostic_name(self.get_fully_qualified_name()), now)
                if self._tools is not None:  # every tool call, by what became of it
                    diag.status[0].values.extend(KeyValue(key=k, value=v) for k, v in self._tools.diagnostic_values())
                self._pub_diag.publish(diag)
        with self._telemetry_part("cache_map"):
            if self._pub_map is not None:
                frame = namespaced_frame(engine.settings.cache_map_frame, self.get_namespace())
                self._pub_map.publish(messages.cache_map(cache_map.spheres(engine.entries(), salt=self._map_salt),
                                                         frame, now))


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
