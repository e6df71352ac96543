"""Node parameters, all built from settings.SPECS (the fields of settings.Settings: names, defaults, ranges, `live`).

- `declare_all(node)`: declares every SPECS entry with a ParameterDescriptor (one-line description,
  numeric range, choices, whether it changes live). Values come from the params file
  (`--ros-args --params-file config/edge.yaml`), `-p name:=value` or `parameter_overrides`.
- `ParameterGate`: the on-set-parameters callback. It validates a change once, by building the
  new Settings (every value and the checks across values), refuses a parameter that needs a reload
  while a model is loaded, and hands the new Settings to a callable supplied by the node, which
  gives it to its one owner, the engine.
"""
from __future__ import annotations

import difflib
import math
import sys
from typing import Any, Callable

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.exceptions import ParameterNotDeclaredException
from rclpy.parameter import Parameter

from simllm_ros import path_checks
from simllm_ros.settings import SPEC_BY_NAME, SPECS, ParamSpec, SettingError, Settings

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def descriptor_for(spec: ParamSpec) -> ParameterDescriptor:
    constraints = []
    if spec.choices is not None:
        constraints.append("one of: " + ", ".join(str(c) for c in spec.choices))
    constraints.append("changes live" if spec.live else "needs reconfigure (refused while active)")
    d = ParameterDescriptor(
        name=spec.name,
        description=spec.description,
        additional_constraints="; ".join(constraints),
        read_only=False,
        dynamic_typing=False,
    )
    if spec.min is not None or spec.max is not None:
        if spec.type is float:
            lo = -sys.float_info.max if spec.min is None else float(spec.min)
            hi = sys.float_info.max if spec.max is None else float(spec.max)
            d.floating_point_range = [FloatingPointRange(from_value=lo, to_value=hi, step=0.0)]
        elif spec.type is int:
            lo = _INT64_MIN if spec.min is None else int(math.ceil(spec.min))
            hi = _INT64_MAX if spec.max is None else int(math.floor(spec.max))
            d.integer_range = [IntegerRange(from_value=lo, to_value=hi, step=0)]
    return d


def _coerce_override(spec: ParamSpec, p: Parameter) -> Parameter:
    """Forgive the usual YAML slips: `cache_threshold: 1` (int for a double), `cache_size: 1000000` (int for a
    string)."""
    v = p.value
    if spec.type is float and isinstance(v, int) and not isinstance(v, bool):
        return Parameter(spec.name, Parameter.Type.DOUBLE, float(v))
    if spec.type is str and isinstance(v, (int, float)) and not isinstance(v, bool):
        return Parameter(spec.name, Parameter.Type.STRING, str(v))
    return p


def declare_all(node) -> None:
    """Declare every SPECS entry; raises SettingError naming the parameter when a given value is invalid."""
    overrides = getattr(node, "_parameter_overrides", None)  # rclpy keeps file/CLI overrides here
    given: dict[str, Any] = {}
    if isinstance(overrides, dict):
        for spec in SPECS:
            if spec.name in overrides:
                overrides[spec.name] = _coerce_override(spec, overrides[spec.name])
                given[spec.name] = overrides[spec.name].value
    try:
        Settings.from_overrides(**given)
    except SettingError as e:
        raise SettingError(f"invalid parameter values (params file or overrides): {e}") from None
    for spec in SPECS:
        node.declare_parameter(spec.name, spec.default, descriptor_for(spec))


def current_values(node) -> dict:
    return {s.name: node.get_parameter(s.name).value for s in SPECS}


def settings_from_node(node) -> Settings:
    """Settings from the node's current parameter values; raises SettingError."""
    return Settings.from_overrides(**current_values(node))


class ParameterGate:
    """Callback for node.add_on_set_parameters_callback.

    is_loaded(): True while a model is loaded (inactive or active); reload-only parameters
    are refused then. state_label(): 'inactive', 'active', ... for messages.
    apply_live(settings, names): gives the new, already validated Settings (which differ from the
    current ones in the live parameters `names`) to the running engine; raises SettingError.
    """

    def __init__(self, node, is_loaded: Callable[[], bool], state_label: Callable[[], str],
                 apply_live: Callable[[Settings, set[str]], None]):
        self._node = node
        self._is_loaded = is_loaded
        self._state_label = state_label
        self._apply_live = apply_live

    def __call__(self, params: list[Parameter]) -> SetParametersResult:
        try:
            reason = self._check_and_apply(params)
        except Exception as e:  # never let a parameter service call take the node down
            reason = f"internal error while applying parameters: {type(e).__name__}: {e}"
        if reason:
            self._node.get_logger().warning(f"parameter change refused: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        return SetParametersResult(successful=True)

    def _check_and_apply(self, params: list[Parameter]) -> str:
        current = current_values(self._node)
        asked = {p.name: p.value for p in params if p.name in SPEC_BY_NAME}  # skip use_sim_time and the like
        if not asked:
            return ""
        try:
            candidate = Settings.from_overrides(**{**current, **asked})  # the one validation
        except SettingError as e:
            return str(e)
        changes = {name: getattr(candidate, name) for name in asked if getattr(candidate, name) != current[name]}
        if not changes:
            return ""
        if not self._is_loaded():
            try:
                for name, value in changes.items():
                    path_checks.check(name, value)  # a path that cannot work is refused when set
            except SettingError as e:
                return str(e)
        if self._is_loaded():
            reload = [name for name in changes if not SPEC_BY_NAME[name].live]
            if reload:
                return (f"'{reload[0]}' needs a reconfigure: deactivate and cleanup first "
                        f"(node is {self._state_label()})")
            try:
                self._apply_live(candidate, set(changes))
            except SettingError as e:
                return str(e)
        self._node.get_logger().info("parameters set: " + ", ".join(f"{k}={v!r}" for k, v in changes.items()))
        return ""


def undeclared_names(node, parameter_list) -> str:
    """'cache_treshold (did you mean cache_threshold?)' for the parameters the node does not have; '' if none.
    (rclpy's own check exhausts a generator before listing the names, so its error said '[]'.)"""
    declared = list(node._parameters)
    out = []
    for p in parameter_list:
        if p.name not in declared:
            close = difflib.get_close_matches(p.name, declared, n=1)
            out.append(p.name + (f" (did you mean {close[0]}?)" if close else ""))
    return ", ".join(out)


def check_undeclared(node, parameter_list) -> None:
    """rclpy's Node._check_undeclared_parameters, naming the undeclared parameters in the refusal (rclpy's own
    message lists none) and where to see the declared ones."""
    if not all(isinstance(p, Parameter) for p in parameter_list):
        raise TypeError(f"parameter must be instance of type '{Parameter!r}'")
    names = undeclared_names(node, parameter_list)
    if names and not node._allow_undeclared_parameters:
        raise ParameterNotDeclaredException(f"{names}; `ros2 param list {node.get_fully_qualified_name()}` "
                                            "shows the declared ones")
