"""ROS messages from the core's plain values, and requests from ROS messages: the copies the node makes.

Why a module of its own: the node wires entities and lifecycle; what a field of a message holds is decided
here, in one place for the service, the topic and the action (they share the Query fields), and can be
checked without a running node.
"""
from __future__ import annotations

import math

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import Point
from std_msgs.msg import ColorRGBA
from visualization_msgs.msg import Marker, MarkerArray

from simllm_ros.cache.cache_map import Sphere
from simllm_ros.serving.health import Health
from simllm_ros.msg import CacheStats, ThermalStatus, ToolCall
from simllm_ros.request import CacheResult, ChatTurn, QueryRequest, QueryResult
from simllm_ros.serving.thermal import ThermalReading

_U32, _U64 = 2**32 - 1, 2**64 - 1


def u32(v) -> int:
    """A count clamped into a uint32 field (a message refuses a value out of range)."""
    return min(max(int(v), 0), _U32)


def u64(v) -> int:
    return min(max(int(v), 0), _U64)


def fill_result(msg, result: QueryResult):
    """Copy a QueryResult into a Query.Response, a QueryResponse or a Generate.Result message."""
    msg.success = bool(result.success)
    msg.error = str(result.error or "")
    msg.answer = str(result.answer or "")
    msg.cache_result = int(CacheResult(result.cache_result))
    msg.similarity = float(result.similarity)
    msg.prompt_tokens = u32(result.prompt_tokens)
    msg.reused_tokens = u32(result.reused_tokens)
    msg.recomputed_tokens = u32(result.recomputed_tokens)
    msg.generated_tokens = u32(result.generated_tokens)
    msg.ttft_ms = float(result.ttft_ms)
    msg.total_ms = float(result.total_ms)
    msg.exact = bool(result.exact)
    msg.draft_tokens_proposed = u32(result.draft_tokens_proposed)
    msg.draft_tokens_accepted = u32(result.draft_tokens_accepted)
    msg.decode_passes = u32(result.decode_passes)
    msg.stop_reason = str(result.stop_reason or "")
    msg.error_estimate = float(result.error_estimate)
    msg.energy_j = float(result.energy_j)
    msg.energy_source = str(result.energy_source or "none: not measured")
    msg.tool_calls = [ToolCall(name=c.name, arguments=c.arguments, status=c.status, result=c.result, error=c.error)
                      for c in result.tool_calls]
    msg.reasoning = str(result.reasoning or "")
    return msg


def request_from(msg, request_id: str = "") -> QueryRequest:
    """A QueryRequest from a Query.Request, a QueryRequest message or a Generate goal (the same fields)."""
    return QueryRequest(prompt=msg.prompt, context=msg.context, cache_scope=msg.cache_scope,
                        max_new_tokens=int(msg.max_new_tokens), allow_approximate=bool(msg.allow_approximate),
                        request_id=request_id, messages=[ChatTurn(m.role, m.content) for m in msg.messages],
                        json_schema=msg.json_schema, stop=list(msg.stop),
                        temperature=None if msg.temperature < 0 else float(msg.temperature),
                        seed=None if msg.seed < 0 else int(msg.seed),
                        approx_error_bound=float(msg.approx_error_bound))


def thermal_status(r: ThermalReading, warn_c: float, critical_c: float, stamp) -> ThermalStatus:
    """~/thermal: every zone (NaN when offline), the hottest and the level with its thresholds."""
    m = ThermalStatus()
    m.stamp = stamp
    m.zone_names = [z.name for z in r.zones]
    m.temperatures_c = [float(z.temp_c) if z.online else math.nan for z in r.zones]
    m.zone_online = [bool(z.online) for z in r.zones]
    m.hottest_zone = r.hottest_name
    m.hottest_c = float(r.hottest_c)
    m.throttle_state = int(r.level)
    m.warn_c = float(warn_c)
    m.critical_c = float(critical_c)
    return m


def cache_stats(stats: dict, stamp) -> CacheStats:
    """~/cache_stats: the engine's statistics by field name, each converted to its field's type."""
    m = CacheStats()
    m.stamp = stamp
    for field, ftype in CacheStats.get_fields_and_field_types().items():
        if field == "stamp" or field not in stats:
            continue
        v = stats[field]
        setattr(m, field, u32(v) if ftype == "uint32" else u64(v) if ftype == "uint64" else
                str(v) if ftype == "string" else float(v))
    return m


def diagnostics(h: Health, name: str, stamp) -> DiagnosticArray:
    """/diagnostics: one status with the level, message, hardware id and key-values that health decided."""
    st = DiagnosticStatus(level=bytes([int(h.level)]), name=name, message=h.message, hardware_id=h.hardware_id)
    st.values = [KeyValue(key=k, value=v) for k, v in h.values]
    arr = DiagnosticArray(status=[st])
    arr.header.stamp = stamp
    return arr


def cache_map(spheres: list[Sphere], frame: str, stamp) -> MarkerArray:
    """~/cache_map: a DELETEALL (rviz forgets entries evicted since), then one sphere marker per entry."""
    arr = MarkerArray()
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
    return arr
