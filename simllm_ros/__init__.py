"""simllm_ros: a ROS 2 node serving a small LLM with KV-cache and answer reuse."""

# The generated msg/srv modules are installed by rosidl into another copy of
# this package (site-packages/simllm_ros). Extending __path__ lets every
# simllm_ros directory on sys.path contribute, so the source tree (e.g. when
# tests run from the repo root) does not hide simllm_ros.msg / simllm_ros.srv.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
