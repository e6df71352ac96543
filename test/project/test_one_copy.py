"""One copy of the hand-written code (issue 59, item 6). The pip-only venv holds only the generated msg/srv/action
modules (scripts/build_interfaces.sh builds with SIMLLM_INSTALL_PYTHON_CODE=OFF) and imports simllm_ros/ from the
checkout that simllm_ros_checkout.pth names; a colcon build installs both into its own prefix (CMakeLists.txt).
Which copy of a module runs must not depend on sys.path's order: there is one."""
import glob
import os
import subprocess
import sys
import sysconfig

import pytest

import simllm_ros
from conftest import REPO

PACKAGE = os.path.join(REPO, "simllm_ros")
SITE = sysconfig.get_path("purelib")
INSTALLED = os.path.join(SITE, "simllm_ros")  # the generated modules, where the venv has them
PTH = os.path.join(SITE, "simllm_ros_checkout.pth")
GENERATED = ("msg", "srv", "action")
REBUILD = "run scripts/build_interfaces.sh again (it removes the old copy)"


def _hand_written() -> list[str]:
    """The checkout's modules, as paths inside the package: settings.py, cli/edge.py, ..."""
    found = glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
    return sorted(os.path.relpath(p, PACKAGE) for p in found)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def test_no_hand_written_module_is_under_site_packages():
    hand = _hand_written()
    assert {"__init__.py", "settings.py", os.path.join("cli", "edge.py")} <= set(hand)  # the scan sees the package
    second = [rel for rel in hand if os.path.exists(os.path.join(INSTALLED, rel))]
    assert second == [], f"a second copy of hand-written modules in {INSTALLED}: {second[:8]}; {REBUILD}"
    if os.path.isdir(INSTALLED):  # nothing there but the generated modules and their type support
        python = [p for p in glob.glob(os.path.join(INSTALLED, "**", "*.py"), recursive=True)
                  if os.path.relpath(p, INSTALLED).split(os.sep)[0] not in GENERATED]
        assert python == [], f"Python files beside the generated modules: {python[:8]}; {REBUILD}"


def test_every_loaded_module_comes_from_the_checkout_or_the_generated_directory():
    import simllm_ros.cli.edge  # noqa: F401  (a module deep in the tree, with what it imports)

    assert simllm_ros.__path__[0] == PACKAGE, simllm_ros.__path__
    for other in simllm_ros.__path__[1:]:  # only directories of generated modules join the path
        assert os.path.isdir(os.path.join(other, "msg")), simllm_ros.__path__
    generated_dirs = {os.path.realpath(p) for p in simllm_ros.__path__[1:]}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] != "simllm_ros" or path is None:
            continue
        # rosidl's type support libraries (simllm_ros_s__rosidl_typesupport_c.so, ...) sit beside msg/ srv/ action/
        support = path.endswith(".so") and os.path.dirname(os.path.realpath(path)) in generated_dirs
        if support or (name.split(".")[1:2] and name.split(".")[1] in GENERATED):
            assert not os.path.realpath(path).startswith(PACKAGE + os.sep), (name, path)
        else:
            assert os.path.realpath(path).startswith(PACKAGE + os.sep), (name, path)


def _pip_only_venv() -> None:
    if not os.path.isdir(os.path.join(INSTALLED, "msg")):
        pytest.skip(f"no generated interfaces in this venv ({INSTALLED}): a venv without ROS, or a colcon prefix")
    assert os.path.isfile(PTH), f"no {PTH}: {REBUILD}"


def test_the_venv_imports_the_checkout_it_names_from_anywhere(tmp_path):
    pytest.importorskip("rclpy")  # the generated modules need ROS: a venv without it has none (test_pythons.sh)
    # From a folder outside any checkout (as a console command runs): the hand-written modules come from the
    # checkout that the .pth names (this one, or the one whose venv a worktree shares), the generated ones from
    # site-packages.
    _pip_only_venv()
    with open(PTH, encoding="utf-8") as f:
        checkout = os.path.realpath(f.read().strip())
    assert os.path.isfile(os.path.join(checkout, "simllm_ros", "__init__.py")), checkout
    code = ("import os, simllm_ros.settings, simllm_ros.cli.edge, simllm_ros.msg\n"
            "for m in (simllm_ros, simllm_ros.settings, simllm_ros.cli.edge, simllm_ros.msg):\n"
            "    print(os.path.realpath(m.__file__))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    init, settings, edge, msg = r.stdout.split()
    here = os.path.join(checkout, "simllm_ros")
    assert (init, settings, edge) == (os.path.join(here, "__init__.py"), os.path.join(here, "settings.py"),
                                      os.path.join(here, "cli", "edge.py"))
    assert msg == os.path.join(os.path.realpath(INSTALLED), "msg", "__init__.py")


def test_the_commands_start_from_anywhere(tmp_path):
    """The console commands (setup.py) and the node executable the launch file starts (lib/simllm_ros/simllm_node)
    import the package from outside the checkout."""
    _pip_only_venv()
    bindir = os.path.dirname(sys.executable)
    query = os.path.join(bindir, "simllm-query")
    if not os.path.exists(query):
        pytest.skip(f"no {query}: the console commands are not installed here (scripts/setup.sh installs them)")
    r = subprocess.run([query, "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "simllm-query" in r.stdout, r.stdout[-1000:] + r.stderr[-2000:]
    node = os.path.join(sys.prefix, "lib", "simllm_ros", "simllm_node")
    assert os.path.isfile(node), f"no {node}: {REBUILD}"
    r = subprocess.run([sys.executable, node, "unexpected"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "simllm_node: error: unexpected arguments ['unexpected']" in r.stderr, r.stderr[-2000:]
