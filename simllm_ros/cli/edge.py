"""`simllm-edge`: run simllm_node and bring it up (configure, activate) on its own, like launch_ros does.

    simllm-edge [--model M] [--cache_threshold X] [--cache_size S] [--warmup_queries F]
                [--lfu_weight X] [--enable_quant_calibration [BOOL]] [--param NAME=VALUE ...]
                [--ros-args --params-file config/edge.yaml -p name:=value ...]

Shortcut flags and --param win over --ros-args values. Exit code 1 if configure or activate fails,
2 for a bad argument or parameter.

Stopping: the first SIGINT or SIGTERM starts an orderly stop: deactivate (new requests refused, the
pool checkpointed at once, the answers in flight finish), cleanup (pool saved if it changed), shutdown.
Further signals only print that the stop is under way: they never interrupt the save. This is what
`ros2 launch` sends (SIGINT, then SIGTERM after sigterm_timeout, then SIGKILL after sigkill_timeout,
5 s each by default): if the SIGKILL lands while long answers are still running, the checkpoint taken
when the stop began holds every entry cached until then. SIGKILL is the way to abort a stop.

`simllm_node` (node_main) is the launch-file target: it creates the node and spins, and leaves
the transitions to the launch file (or to `ros2 lifecycle set`). On exit it shuts the node down
from whatever state it is in, so the pool is still saved.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from simllm_ros.settings import SPEC_BY_NAME, SettingError, check_value

SHORTCUTS = ("model", "cache_threshold", "cache_size", "warmup_queries", "lfu_weight", "enable_quant_calibration")


def _say(prog: str, msg: str) -> None:
    print(f"[{prog}] {msg}", flush=True)


def parse_value(name: str, text: str):
    """Text from the command line -> the parameter's type (its Settings field's); raises SettingError."""
    spec = SPEC_BY_NAME.get(name)
    if spec is None:
        raise SettingError(f"unknown parameter '{name}' (known: {', '.join(sorted(SPEC_BY_NAME))})")
    t = spec.type
    s = str(text).strip()
    value: bool | int | float | str
    if t is bool:
        low = s.lower()
        if low in ("1", "true", "yes", "on"):
            value = True
        elif low in ("0", "false", "no", "off"):
            value = False
        else:
            raise SettingError(f"{name} must be true or false, got {text!r}")
    elif t is int:
        try:
            value = int(s, 0)
        except ValueError:
            raise SettingError(f"{name} must be an integer, got {text!r}") from None
    elif t is float:
        try:
            value = float(s)
        except ValueError:
            raise SettingError(f"{name} must be a number, got {text!r}") from None
    else:
        value = str(text)
    return check_value(name, value)


def _esc(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings ('30%' in descriptions)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simllm-edge",
        description="Run the simllm_ros LLM node (lifecycle: configured and activated automatically).",
        epilog="Arguments after --ros-args go to ROS, e.g. --ros-args --params-file config/edge.yaml "
               "-p queue_limit:=4. Shortcut flags and --param override them.")
    for name in SHORTCUTS:
        spec = SPEC_BY_NAME[name]
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        extra = " (changes live)" if spec.live else ""
        if spec.type is bool:
            p.add_argument(*flags, dest=name, nargs="?", const="true", metavar="BOOL",
                           help=_esc(f"{spec.description}{extra}; default {spec.default}"))
        else:
            rng = f", range [{spec.min}, {spec.max}]" if spec.min is not None else ""
            p.add_argument(*flags, dest=name, metavar=spec.type.__name__.upper(),
                           help=_esc(f"{spec.description}{extra}; default {spec.default!r}{rng}"))
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="any parameter (a field of settings.Settings; docs/settings.md), repeatable")
    return p


def overrides_from_args(args: argparse.Namespace) -> dict:
    """Shortcut flags and --param NAME=VALUE -> {name: typed value}; raises SettingError."""
    out = {}
    for item in args.param:
        if "=" not in item:
            raise SettingError(f"--param expects NAME=VALUE, got {item!r}")
        name, text = item.split("=", 1)
        out[name.strip()] = parse_value(name.strip(), text)
    for name in SHORTCUTS:
        text = getattr(args, name, None)
        if text is not None:
            out[name] = parse_value(name, text)
    return out


class _Runner:
    """rclpy init, node, MultiThreadedExecutor spun in a thread, signal handling, orderly teardown."""

    def __init__(self, prog: str, argv: list[str], overrides: dict):
        # local: ROS and the node (torch, the engine) load when a node starts: this module imports without ROS
        import rclpy
        from rclpy.parameter import Parameter
        from rclpy.signals import SignalHandlerOptions

        from simllm_ros.ros.node import SimLLMNode, make_executor

        self.prog = prog
        self.stop = threading.Event()
        # Our own SIGINT/SIGTERM handlers: the context stays valid until the node is shut down
        # (rclpy's handlers would shut the context first, and the transitions could not publish).
        rclpy.init(args=[prog] + argv, signal_handler_options=SignalHandlerOptions.NO)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.node = SimLLMNode(parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
        self.executor = make_executor(self.node)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self._spin, name="executor", daemon=True)
        self.thread.start()

    def _on_signal(self, signum, frame):
        """First signal: stop (the main thread runs close()). Later ones: say so and return, so that no
        KeyboardInterrupt can land inside the drain or the save. os.write: print() is not reentrant."""
        if self.stop.is_set():
            name = signal.Signals(signum).name
            try:
                os.write(2, f"[{self.prog}] {name}: already stopping (answers in flight finish, then the pool "
                            "is saved); SIGKILL aborts, keeping the last checkpoint\n".encode())
            except OSError:
                pass
            return
        self.stop.set()

    def _spin(self):
        # local: rclpy: this module imports without ROS (test/project/test_one_copy.py)
        from rclpy.executors import ExternalShutdownException
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass
        except Exception as e:  # keep the process alive long enough to shut down cleanly
            _say(self.prog, f"executor stopped: {type(e).__name__}: {e}")
        finally:
            self.stop.set()

    def wait(self):
        while not self.stop.wait(0.5):
            pass

    def close(self):
        # local: rclpy: this module imports without ROS (test/project/test_one_copy.py)
        import rclpy
        node = self.node
        try:
            st = node.state_label()
            if st == "active":
                _say(self.prog, "deactivating (in-flight requests finish)")
                node.trigger_deactivate()
                st = node.state_label()
            if st == "inactive":
                _say(self.prog, "cleaning up (saving the pool, unloading the model)")
                node.trigger_cleanup()
                st = node.state_label()
            if st in ("unconfigured", "inactive", "active"):
                node.trigger_shutdown()
        except Exception as e:
            _say(self.prog, f"shutdown: {type(e).__name__}: {e}")
        self.executor.shutdown(timeout_sec=10)
        self.thread.join(timeout=30)  # join before destroying, or the process may abort at exit
        node.destroy_node()
        rclpy.try_shutdown()
        # The stop is complete. Python puts SIG_DFL back for handled signals while the interpreter exits,
        # so a late SIGTERM (ros2 launch escalating) would turn exit 0 into "killed"; ignored ones stay
        # ignored.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _split(prog: str, argv: list[str] | None) -> tuple[list[str], list[str]]:
    # local: rclpy: this module imports without ROS (test/project/test_one_copy.py)
    from rclpy.utilities import remove_ros_args
    argv = list(sys.argv[1:] if argv is None else argv)
    own = remove_ros_args([prog] + argv)[1:]
    return argv, own


def main(argv: list[str] | None = None) -> int:
    prog = "simllm-edge"
    argv, own = _split(prog, argv)
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        overrides = overrides_from_args(args)
    except SettingError as e:
        parser.error(str(e))
    # local: rclpy.lifecycle after argument parsing (this module imports without ROS)
    from rclpy.lifecycle import TransitionCallbackReturn
    try:
        runner = _Runner(prog, argv, overrides)
    except SettingError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        # local: rclpy: this module imports without ROS (test/project/test_one_copy.py)
        import rclpy
        rclpy.try_shutdown()
        return 2
    code = 0
    try:
        _say(prog, "configuring: loading model and embedder (a first run converts the GGUF model, ~15 s)")
        t0 = time.monotonic()
        if runner.node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            _say(prog, "configure failed (see the error above); fix the parameter and retry")
            code = 1
        elif runner.stop.is_set():
            _say(prog, f"configured in {time.monotonic() - t0:.1f} s, but a stop was requested: not activating")
        else:
            _say(prog, f"configured in {time.monotonic() - t0:.1f} s; activating")
            if runner.node.trigger_activate() != TransitionCallbackReturn.SUCCESS:
                _say(prog, "activate failed (see the error above)")
                code = 1
            else:
                name = runner.node.get_fully_qualified_name()
                _say(prog, f"active: service {name}/query, topics {name}/requests -> {name}/responses. "
                           "Ctrl-C to stop.")
                runner.wait()
                _say(prog, "stopping")
    except KeyboardInterrupt:
        _say(prog, "interrupted")
    finally:
        runner.close()
    _say(prog, "stopped")
    return code


def node_main(argv: list[str] | None = None) -> int:
    """`simllm_node`: node only; transitions come from the launch file or `ros2 lifecycle set`."""
    prog = "simllm_node"
    argv, own = _split(prog, argv)
    if own:
        print(f"{prog}: error: unexpected arguments {own}; use --ros-args -p name:=value", file=sys.stderr)
        return 2
    try:
        runner = _Runner(prog, argv, {})
    except SettingError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        # local: rclpy: this module imports without ROS (test/project/test_one_copy.py)
        import rclpy
        rclpy.try_shutdown()
        return 2
    try:
        _say(prog, f"{runner.node.get_fully_qualified_name()} is up (unconfigured); waiting for transitions")
        runner.wait()
    except KeyboardInterrupt:
        pass
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
