#!/usr/bin/env bash
# Build the simllm_ros interfaces (msg/, srv/, action/) and install them into the
# Python venv that holds the ros-* PyPI wheels, with plain cmake; point the venv
# at this checkout's simllm_ros/.
#
# Usage: scripts/build_interfaces.sh [VENV]      (default: <repo>/.venv)
#        FORCE=1 scripts/build_interfaces.sh     (rebuild even if unchanged)
#
# One copy of the hand-written code: cmake installs only the generated modules
# (-DSIMLLM_INSTALL_PYTHON_CODE=OFF; a colcon build installs both, CMakeLists.txt)
# into <venv>/lib/pythonX.Y/site-packages/simllm_ros, without an __init__.py, and
# simllm_ros_checkout.pth there puts this checkout on the venv's sys.path. The
# checkout's simllm_ros/ is then the regular package every import finds (a
# directory without __init__.py earlier on sys.path is only a namespace portion),
# and its __init__.py adds the generated directory to its __path__. Edits to
# simllm_ros/ need no reinstall; a venv built before this removes its old copy of
# the hand-written modules here (files the install no longer lists).
#
# Idempotent: the cmake configure+build is skipped when msg/ srv/ action/
# CMakeLists.txt package.xml (and the venv's python) are unchanged since the last
# successful build (content hash in build/interfaces/.simllm_stamp) and the
# installed generated modules are still present in the venv; the install step
# (about 1 s) always runs.
#
# Install prefix = the venv itself (share/, lib/, lib/pythonX.Y/site-packages).
# At run time nothing needs to be sourced: the wheels' ros_wheels_bootstrapper
# .pth re-executes the venv's python with LD_LIBRARY_PATH including
# <venv>/lib, which is where our libsimllm_ros__rosidl_*.so land, and
# AMENT_PREFIX_PATH is not needed for Python message type support.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VENV:-$REPO/.venv}}"
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
BUILD="$REPO/build/interfaces"
STAMP="$BUILD/.simllm_stamp"

say() { echo "[build_interfaces] $*"; }
die() { echo "[build_interfaces] ERROR: $*" >&2; exit 1; }

[ -x "$PY" ] || die "no python at $PY (venv missing?)"
command -v cmake >/dev/null || die "cmake not found"

# The venv is the ament prefix (share/ament_index, share/*/cmake, lib/).
export AMENT_PREFIX_PATH="$VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
export CMAKE_PREFIX_PATH="$VENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
export PATH="$VENV/bin:$PATH"
export PYTHONDONTWRITEBYTECODE=1

# Build-time CMake packages: their pip wheels' dependency metadata is
# incomplete, so check for them explicitly.
missing=()
for p in ament_cmake ament_cmake_core ament_cmake_python rosidl_default_generators \
         rosidl_core_generators ament_cmake_ros_core ament_cmake_include_directories \
         builtin_interfaces action_msgs rosidl_generator_py; do
  [ -d "$VENV/share/$p/cmake" ] || missing+=("ros-${p//_/-}")
done
if [ ${#missing[@]} -gt 0 ]; then
  die "missing in venv: ${missing[*]} (pip install them plus ros-ament-package catkin-pkg)"
fi

SITE_REL="$("$PY" -c 'import sysconfig,os;print(os.path.relpath(sysconfig.get_path("purelib"), sysconfig.get_config_var("base")))')"
SITE="$VENV/$SITE_REL"
PKG_DIR="$SITE/simllm_ros"
CMAKE_OPTIONS=(-DSIMLLM_INSTALL_PYTHON_CODE=OFF)

# Content hash of everything that affects the generated code.
hash_inputs() {
  (
    cd "$REPO"
    find msg srv action -type f \( -name '*.msg' -o -name '*.srv' -o -name '*.action' \) | LC_ALL=C sort
    echo CMakeLists.txt
    echo package.xml
  ) | while read -r f; do
    printf '%s ' "$f"; sha256sum < "$REPO/$f"
  done
  echo "venv=$VENV"
  echo "options=${CMAKE_OPTIONS[*]}"
  "$PY" -c 'import sys;print(sys.version)'
}
NEW_HASH="$(hash_inputs | sha256sum | cut -d' ' -f1)"
OLD_HASH="$(cat "$STAMP" 2>/dev/null || true)"

installed_ok() {
  [ -f "$VENV/share/simllm_ros/package.xml" ] &&
  compgen -G "$PKG_DIR/simllm_ros_s__rosidl_typesupport_c*.so" >/dev/null &&
  compgen -G "$VENV/lib/libsimllm_ros__rosidl_typesupport_c.so" >/dev/null &&
  [ -f "$PKG_DIR/srv/_query.py" ]
}

t0=$(date +%s)
mkdir -p "$BUILD"
LOGS="$REPO/build"   # interfaces.{configure,build,install}.log
if [ "${FORCE:-0}" != "1" ] && [ "$NEW_HASH" = "$OLD_HASH" ] && installed_ok; then
  say "interfaces unchanged since last build, skipping cmake build"
else
  # A cache from another source tree or prefix (repo moved, other venv) is useless.
  if [ -f "$BUILD/CMakeCache.txt" ] && {
       ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$REPO" "$BUILD/CMakeCache.txt" ||
       ! grep -qx "CMAKE_INSTALL_PREFIX:PATH=$VENV" "$BUILD/CMakeCache.txt"; }; then
    say "stale build dir (other repo/prefix), wiping $BUILD"
    rm -rf "$BUILD"
    mkdir -p "$BUILD"
  fi
  rm -f "$STAMP"
  gen=()
  if [ ! -f "$BUILD/CMakeCache.txt" ] && command -v ninja >/dev/null; then
    gen=(-G Ninja)
  fi
  say "configuring ($BUILD, prefix $VENV)"
  cmake -S "$REPO" -B "$BUILD" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$VENV" \
    -DPython3_EXECUTABLE="$PY" \
    -DPython3_FIND_STRATEGY=LOCATION \
    -DBUILD_TESTING=OFF \
    "${CMAKE_OPTIONS[@]}" \
    > "$LOGS/interfaces.configure.log" 2>&1 ||
    { tail -40 "$LOGS/interfaces.configure.log" >&2; die "cmake configure failed (log: $LOGS/interfaces.configure.log)"; }
  say "building"
  cmake --build "$BUILD" -j "$(nproc)" > "$LOGS/interfaces.build.log" 2>&1 ||
    { tail -40 "$LOGS/interfaces.build.log" >&2; die "build failed (log: $LOGS/interfaces.build.log)"; }
fi

say "installing into $VENV"
cmake --install "$BUILD" > "$LOGS/interfaces.install.log" 2>&1 ||
  { tail -40 "$LOGS/interfaces.install.log" >&2; die "install failed (log: $LOGS/interfaces.install.log)"; }

# Remove what the install no longer lists from the generated package directory: a deleted interface, and in a
# venv built before SIMLLM_INSTALL_PYTHON_CODE=OFF the old copy of the hand-written modules, with their bytecode and
# the directories left empty.
if [ -f "$BUILD/install_manifest.txt" ] && [ -d "$PKG_DIR" ]; then
  while IFS= read -r -d '' f; do
    if ! grep -qxF "$f" "$BUILD/install_manifest.txt"; then
      say "removing stale $f"
      rm -f "$f"
    fi
  done < <(find "$PKG_DIR" -path '*/__pycache__' -prune -o -type f -print0)
  # bytecode whose source is gone (__pycache__/name.cpython-311.pyc without ../name.py)
  while IFS= read -r -d '' f; do
    src="$(dirname "$(dirname "$f")")/$(basename "$f" | cut -d. -f1).py"
    [ -f "$src" ] || rm -f "$f"
  done < <(find "$PKG_DIR" -path '*/__pycache__/*.pyc' -type f -print0)
  find "$PKG_DIR" -mindepth 1 -depth -type d -empty -delete
fi

# The checkout on the venv's sys.path (after site-packages): the one copy of the hand-written modules.
echo "$REPO" > "$SITE/simllm_ros_checkout.pth"

echo "$NEW_HASH" > "$STAMP"
say "done in $(( $(date +%s) - t0 )) s (generated modules: $PKG_DIR; hand-written: $REPO/simllm_ros)"
