"""simllm_ros: a ROS 2 node serving a small LLM with KV-cache and answer reuse."""

# rosidl installs the generated msg/srv/action modules into another simllm_ros directory: site-packages in the
# pip-only venv (scripts/build_interfaces.sh), install/ in a colcon workspace. Those directories, and only those
# (they hold msg/), join this package's path after this one, so a hand-written module comes from the directory of
# this file alone, never from another checkout on sys.path.
import os
from pkgutil import extend_path

__path__ = [p for p in extend_path(__path__, __name__) if p in __path__ or os.path.isdir(os.path.join(p, "msg"))]
del os, extend_path
