"""Launch simllm_node as a managed (lifecycle) node and bring it to active.

    ros2 launch simllm_ros edge.launch.py [params_file:=...] [model:=...] [cache_threshold:=0.85]
                                          [cache_size:=512MB] [namespace:=robot1] [log_level:=info]

Parameters come from config/edge.yaml (installed to share/simllm_ros/config) unless params_file
is given; model, cache_threshold and cache_size override it when set (empty: keep the file's).
The file's key is `/**`, so its values reach the node in any namespace: several robots can run
`namespace:=robot1`, `namespace:=robot2`, ... with one file (a block keyed `/robot1/simllm_node:` in
the same file gives one robot its own values). Its services, topics and action then live under
/robot1/simllm_node/, and /diagnostics names it "robot1/simllm_node: LLM service".
The launch file emits configure, then activate once the node reached 'inactive' (the pattern of
ros2/demos lifecycle_py and nav2's lifecycle bring-up). A failed configure (e.g. a model path
that does not exist) is logged and ends the launch.

Needs a ROS 2 install with launch_ros (not available from PyPI; there, use `simllm-edge`).
"""
import os

import lifecycle_msgs.msg
from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, LogInfo, OpaqueFunction, RegisterEventHandler
from launch.events import Shutdown, matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState

OVERRIDES = {  # launch argument -> parameter type
    "model": str,
    "cache_threshold": float,
    "cache_size": str,
}


def _node_and_transitions(context, *args, **kwargs):
    params_file = LaunchConfiguration("params_file").perform(context)
    overrides = {}
    for name, typ in OVERRIDES.items():
        text = LaunchConfiguration(name).perform(context).strip()
        if text:
            overrides[name] = typ(text)

    node = LifecycleNode(
        package="simllm_ros",
        executable="simllm_node",
        name="simllm_node",
        namespace=LaunchConfiguration("namespace"),
        parameters=[params_file] + ([overrides] if overrides else []),
        ros_arguments=["--log-level", LaunchConfiguration("log_level")],
        output="screen",
        emulate_tty=True,
    )

    configure = EmitEvent(event=ChangeState(
        lifecycle_node_matcher=matches_action(node),
        transition_id=lifecycle_msgs.msg.Transition.TRANSITION_CONFIGURE))

    activate_when_configured = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node, start_state="configuring", goal_state="inactive",
        entities=[
            LogInfo(msg="simllm_node configured; activating"),
            EmitEvent(event=ChangeState(
                lifecycle_node_matcher=matches_action(node),
                transition_id=lifecycle_msgs.msg.Transition.TRANSITION_ACTIVATE)),
        ]))

    stop_when_configure_failed = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node, start_state="configuring", goal_state="unconfigured",
        entities=[
            LogInfo(msg="simllm_node failed to configure (see its error above); stopping"),
            EmitEvent(event=Shutdown(reason="simllm_node configure failed")),
        ]))

    announce_active = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node, start_state="activating", goal_state="active",
        entities=[LogInfo(msg="simllm_node active: ~/query, ~/generate (action), ~/embed, ~/requests -> ~/responses")]))

    # Handlers first, so no transition event can be missed.
    return [activate_when_configured, stop_when_configure_failed, announce_active, node, configure]


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory("simllm_ros"), "config", "edge.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="YAML parameters file for simllm_node"),
        DeclareLaunchArgument("namespace", default_value="", description="node namespace"),
        DeclareLaunchArgument("log_level", default_value="info", description="ROS log level"),
        DeclareLaunchArgument("model", default_value="",
                              description="override: HF id or local path of the LLM (empty: from params_file)"),
        DeclareLaunchArgument("cache_threshold", default_value="",
                              description="override: cosine similarity for SEMANTIC reuse, 0..1 (empty: from params_file)"),
        DeclareLaunchArgument("cache_size", default_value="",
                              description="override: KV pool budget, e.g. 512MB or 30% (empty: from params_file)"),
        OpaqueFunction(function=_node_and_transitions),
    ])
