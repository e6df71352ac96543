"""Shared pytest setup: make the repository root importable as `simllm_ros`; ROS test isolation and helpers.

ROS isolation is set here, at import, before any test module can call rclpy.init: a ROS_DOMAIN_ID
derived from the pid and discovery limited to this host, so parallel test runs never see each other.
"""
import contextlib
import importlib.util
import os
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


from simllm_ros.ros.domain import pick_domain  # noqa: E402  (no ROS import: runs before rclpy.init)

os.environ["ROS_DOMAIN_ID"] = str(pick_domain(os.getpid()))
# Under pytest-xdist (scripts/test.sh) each worker takes its share of the cores, read by torch at import: two
# workers at two threads each on two cores spent ~50% more CPU on the same tests (threads waiting on each other).
# Tests of thread counts set theirs explicitly; no bit of any result depends on the count (test_compute_threads).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EDGE_YAML = os.path.join(REPO, "config", "edge.yaml")

# The tests are laid out by the part they test (test/kernels, cache, model, serving, ros, bench, cli, project); the
# shared helpers (this file, core_fixtures, random_gguf, ...) sit here in test/, importable from every folder
# (pytest.ini: pythonpath). The test files that need ROS 2 (rclpy, ROS message types, our generated msg/srv, a node
# over DDS) are the files in test/ros/, and only those. The rest is the ROS-free suite, which also runs on Pythons
# without a ROS (scripts/test_pythons.sh: 3.10 and 3.12 venvs). Where rclpy is not importable test/ros/ is not
# collected, and the header says so; test_python_versions checks that every test file that uses ROS is in test/ros/.
ROS_TEST_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ros")
HAVE_ROS = importlib.util.find_spec("rclpy") is not None
collect_ignore = [] if HAVE_ROS else [ROS_TEST_DIR]


def pytest_report_header(config):
    if not HAVE_ROS:
        return "rclpy is not importable here: the ROS-free suite only (test/ros/ is not collected)"
    return None


# --------------------------------------------------------------------------- fake sysfs
class FakeThermal:
    """A /sys/class/thermal look-alike: zones with `type` and `temp` (milli-degrees) files."""

    def __init__(self, root):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def add(self, index: int, zone_type: str, celsius: float | None = None, raw: str | None = None):
        d = os.path.join(self.root, f"thermal_zone{index}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "type"), "w") as f:
            f.write(zone_type + "\n")
        if celsius is not None or raw is not None:
            self.set(index, celsius, raw)

    def set(self, index: int, celsius: float | None = None, raw: str | None = None):
        text = raw if raw is not None else str(int(round(celsius * 1000)))
        path = os.path.join(self.root, f"thermal_zone{index}", "temp")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)  # atomic: the node never reads a half-written file


def cpu_gpu_zones(root) -> FakeThermal:
    """A cool CPU zone (0) and a GPU zone (1) that the tests heat up."""
    t = FakeThermal(str(root))
    t.add(0, "cpu-thermal", 45.0)
    t.add(1, "gpu-thermal", 50.0)
    return t


@pytest.fixture
def fake_thermal(tmp_path):
    return FakeThermal(str(tmp_path / "thermal"))


# --------------------------------------------------------------------------- rclpy harness
def wait_until(predicate, timeout: float, interval: float = 0.02):
    """Poll predicate() until truthy; return its value or None after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        v = predicate()
        if v:
            return v
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def wait_future(future, timeout: float):
    """Block the test thread on an rclpy future completed by the executor thread."""
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    if not done.wait(timeout):
        raise TimeoutError(f"no answer within {timeout} s")
    return future.result()


class RosHarness:
    """The node under test and a client node, both spun by one MultiThreadedExecutor in a thread.

    Everything the tests do goes through DDS: lifecycle services, the Query service, topics,
    parameter services.
    """

    TRANSITIONS = {"configure": 1, "cleanup": 2, "activate": 3, "deactivate": 4,
                   "unconfigured_shutdown": 5, "inactive_shutdown": 6, "active_shutdown": 7}

    def __init__(self, node_name: str, params_files: list[str], overrides: dict | None = None, namespace: str = ""):
        import rclpy
        from rclpy.context import Context
        from rclpy.parameter import Parameter

        from simllm_ros.ros.node import SimLLMNode, make_executor

        self.name = node_name
        self.namespace = "/" + namespace.strip("/") if namespace.strip("/") else ""
        self.fqn = f"{self.namespace}/{node_name}"  # the node's full name: /robot1/simllm_node
        self.context = Context()
        rclpy.init(context=self.context)
        cli_args = ["--ros-args"]
        for p in params_files:
            cli_args += ["--params-file", p]
        overrides = [Parameter(k, value=v) for k, v in (overrides or {}).items()]
        self.node = SimLLMNode(node_name, context=self.context, cli_args=cli_args, parameter_overrides=overrides,
                               namespace=self.namespace or None)
        self.client = rclpy.create_node(f"test_client_{os.getpid()}", context=self.context,
                                        namespace=self.namespace or None)
        self.executor = make_executor(self.node, context=self.context)
        self.executor.add_node(self.node)
        self.executor.add_node(self.client)
        self._closing = False
        self._serving = threading.Event()
        self._serving.set()
        self._lock = threading.Lock()
        self.received: dict[str, list] = {}
        # Clients before the executor thread: rclpy's ActionClient registers itself as a waitable before it
        # sets its own lock, and an executor spinning meanwhile died on that (AttributeError '_lock', seen
        # once in a fresh-clone run), after which every call of the module's tests timed out.
        self._make_clients()
        self._thread = threading.Thread(target=self._spin, name="test-executor", daemon=True)
        self._thread.start()

    def _spin(self):
        from rclpy.exceptions import InvalidHandle
        from rclpy.executors import ExternalShutdownException
        while not self._closing and self.context.ok():
            self._serving.wait()
            try:
                self.executor.spin_once(timeout_sec=0.2)
            except ExternalShutdownException:
                return
            except InvalidHandle:
                # A test destroyed one of the client's entities from its own thread while the executor was
                # building its wait set (an rclpy race; seen once in CI-like runs). The entity is gone by the
                # next spin, so keep serving: a dead executor thread would time out every later call.
                continue

    @contextlib.contextmanager
    def executor_held(self):
        """Stop taking new work from DDS (callbacks already running go on), as a node whose executor threads
        are all busy would; everything that arrives meanwhile waits in the DDS readers."""
        self._serving.clear()
        time.sleep(0.5)  # the spin_once in progress returns
        try:
            yield
        finally:
            self._serving.set()

    def _make_clients(self):
        from diagnostic_msgs.msg import DiagnosticArray
        from lifecycle_msgs.srv import ChangeState, GetState
        from rcl_interfaces.srv import DescribeParameters, GetParameters, SetParameters
        from rclpy.action import ActionClient
        from visualization_msgs.msg import MarkerArray

        from simllm_ros.action import Generate
        from simllm_ros.msg import CacheStats, QueryRequest, QueryResponse, ThermalStatus
        from simllm_ros.ros.qos import CLIENT_QOS
        from simllm_ros.srv import Embed, Query

        c, n = self.client, self.fqn
        self.change_state_cli = c.create_client(ChangeState, f"{n}/change_state")
        self.get_state_cli = c.create_client(GetState, f"{n}/get_state")
        self.set_params_cli = c.create_client(SetParameters, f"{n}/set_parameters")
        self.get_params_cli = c.create_client(GetParameters, f"{n}/get_parameters")
        self.describe_cli = c.create_client(DescribeParameters, f"{n}/describe_parameters")
        self.query_cli = c.create_client(Query, f"{n}/query", qos_profile=CLIENT_QOS)
        self.embed_cli = c.create_client(Embed, f"{n}/embed", qos_profile=CLIENT_QOS)
        self.generate_cli = ActionClient(c, Generate, f"{n}/generate")
        self.request_pub = c.create_publisher(QueryRequest, f"{n}/requests", 100)
        for topic, typ in ((f"{n}/responses", QueryResponse), (f"{n}/cache_stats", CacheStats),
                           (f"{n}/thermal", ThermalStatus), ("/diagnostics", DiagnosticArray),
                           (f"{n}/cache_map", MarkerArray)):
            self.received[topic] = []
            c.create_subscription(typ, topic, lambda m, t=topic: self._store(t, m), 100)
        from std_msgs.msg import String

        from simllm_ros.ros.node import LOAD_PROGRESS_QOS

        self.received[f"{n}/load_progress"] = []  # configure's progress lines (the last 20 kept for late joiners)
        c.create_subscription(String, f"{n}/load_progress", lambda m, t=f"{n}/load_progress": self._store(t, m),
                              LOAD_PROGRESS_QOS)
        for cli in (self.change_state_cli, self.get_state_cli, self.set_params_cli, self.get_params_cli):
            assert cli.wait_for_service(timeout_sec=10), f"{cli.srv_name} not available"

    def _store(self, topic, msg):
        with self._lock:
            self.received[topic].append(msg)

    def messages(self, topic: str) -> list:
        with self._lock:
            return list(self.received[topic])

    def clear(self, topic: str) -> None:
        with self._lock:
            self.received[topic].clear()

    def wait_message(self, topic: str, predicate=lambda m: True, timeout: float = 10.0, after: int = 0):
        """First message on topic (from index `after`) satisfying predicate, or None."""
        def find():
            for m in self.messages(topic)[after:]:
                if predicate(m):
                    return m
            return None
        return wait_until(find, timeout)

    # lifecycle
    def change_state(self, transition: str, timeout: float = 120.0) -> bool:
        from lifecycle_msgs.srv import ChangeState
        req = ChangeState.Request()
        req.transition.id = self.TRANSITIONS[transition]
        return wait_future(self.change_state_cli.call_async(req), timeout).success

    def state(self) -> str:
        from lifecycle_msgs.srv import GetState
        return wait_future(self.get_state_cli.call_async(GetState.Request()), 10).current_state.label

    def ensure_active(self):
        st = self.state()
        if st == "unconfigured":
            assert self.change_state("configure"), "configure failed"
            st = self.state()
        if st == "inactive":
            assert self.change_state("activate"), "activate failed"
        assert self.state() == "active"
        assert self.query_cli.wait_for_service(timeout_sec=10)

    # parameters
    def set_params(self, **values):
        """Set atomically-per-parameter; returns the list of SetParametersResult."""
        from rcl_interfaces.srv import SetParameters
        from rclpy.parameter import Parameter
        req = SetParameters.Request(parameters=[Parameter(k, value=v).to_parameter_msg() for k, v in values.items()])
        return wait_future(self.set_params_cli.call_async(req), 10).results

    def get_param(self, name: str):
        from rcl_interfaces.srv import GetParameters
        from rclpy.parameter import parameter_value_to_python
        res = wait_future(self.get_params_cli.call_async(GetParameters.Request(names=[name])), 10)
        return parameter_value_to_python(res.values[0])

    def describe(self, name: str):
        from rcl_interfaces.srv import DescribeParameters
        return wait_future(self.describe_cli.call_async(DescribeParameters.Request(names=[name])), 10).descriptors[0]

    # requests
    def query_async(self, prompt: str, context: str = "", scope: str = "", max_new_tokens: int = 12,
                    allow_approximate: bool = True):
        from simllm_ros.srv import Query
        return self.query_cli.call_async(Query.Request(prompt=prompt, context=context, cache_scope=scope,
                                                       max_new_tokens=max_new_tokens,
                                                       allow_approximate=allow_approximate))

    def query(self, prompt: str, timeout: float = 120.0, **kw):
        return wait_future(self.query_async(prompt, **kw), timeout)

    def call(self, client, request, timeout: float = 120.0):
        """Any service call through DDS, waiting for the service first."""
        assert client.wait_for_service(timeout_sec=10), f"{client.srv_name} not available"
        return wait_future(client.call_async(request), timeout)

    def publish_request(self, request_id: str, prompt: str, max_new_tokens: int = 12, **kw):
        from simllm_ros.msg import QueryRequest
        self.request_pub.publish(QueryRequest(request_id=request_id, prompt=prompt,
                                              max_new_tokens=max_new_tokens, allow_approximate=True, **kw))

    def close(self):
        import rclpy
        try:
            if self.state() not in ("finalized",):
                self.node.trigger_shutdown()
        except Exception:
            pass
        self._closing = True
        self._serving.set()
        self.executor.shutdown(timeout_sec=10)
        self._thread.join(timeout=30)
        self.client.destroy_node()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


@pytest.fixture(scope="module")
def ros_harness_factory():
    """Call with (node_name, params_files, overrides, namespace); every harness made is closed at module end."""
    made = []

    def make(node_name, params_files, overrides=None, namespace=""):
        h = RosHarness(node_name, params_files, overrides, namespace)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """The random GGUF files the test_gguf_* modules share (gguf_files.py), one set per test process: a session
    fixture here, not one imported into each module (that made one per module, and gguf_files' backends, one per
    name in the process, then belonged to the other module's files)."""
    from gguf_files import write_files  # torch and the model code: only where a test asks for these files

    return write_files(tmp_path_factory)
