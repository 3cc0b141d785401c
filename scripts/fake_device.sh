#!/usr/bin/env bash
# Usage: scripts/fake_device.sh [ENV]          ENV: an environment of scripts/env.sh (default
#                                              paddleformers), created if it does not exist yet
#        scripts/fake_device.sh --python PY    the Paddle installed for interpreter PY
# Builds the fake accelerator (fake_device/*.cc, a Paddle custom-device plugin) against the
# Paddle headers of that environment, unless a build of the same sources for the same Paddle
# version and Python tag is cached, and prints on stdout exactly two lines:
#   CUSTOM_DEVICE_ROOT=<folder holding only libfakedev.so>
#   DEVICE=fakedev
# The same folder holds kernels/: the plugin beside libfakedev_kernels.so (fake_device/kernels/*.cc: a
# `contiguous` kernel, linked against the Paddle library the process loads), for the tests of exports
# that compute on the device (tests/_fake_device.py: device_env(kernels=True)).
# Progress and compiler output go to stderr. Builds are cached outside the clone, beside the
# environments (<env root>/../fake_device/paddle<version>-<python tag>-<hash of the sources and
# flags>/), and several clones or test runs may build at once (flock, then an atomic rename).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--python" ]; then
  py=${2:?usage: scripts/fake_device.sh [ENV | --python PY]}
else
  py=$("$here/scripts/env.sh" "${1:-paddleformers}" | tail -n 1)
fi
env_root=$("$here/scripts/env.sh" --root)
cache="$(dirname "$env_root")/fake_device"

# what the key is made of, without importing paddle (slow, and noisy on stderr)
mapfile -t info < <(unset PYTHONPATH; "$py" - <<'EOF'
import importlib.metadata, importlib.util, os, sys
spec = importlib.util.find_spec("paddle")
print(importlib.metadata.version("paddlepaddle"))
print("cp%d%d" % sys.version_info[:2])
print(os.path.join(spec.submodule_search_locations[0], "include"))
EOF
)
[ "${#info[@]}" -eq 3 ] || { echo "fake_device.sh: no paddlepaddle found for $py" >&2; exit 1; }
paddle_version=${info[0]}
python_tag=${info[1]}
include=${info[2]}
header="$include/paddle/phi/backends/device_ext.h"
[ -f "$header" ] || { echo "fake_device.sh: $header not found (paddlepaddle $paddle_version in $py)" >&2; exit 1; }

cxx=${CXX:-g++}
flags=(-O2 -std=c++17 -shared -fPIC -pthread -Wall -Wextra -Werror)
sources=("$here"/fake_device/*.cc)
kernel_sources=("$here"/fake_device/kernels/*.cc)
paddle_lib="$(dirname "$include")/base/libpaddle.so"
# the kernels use Paddle's C++ API: its headers of this version, the process's libpaddle.so (found by its
# soname, already loaded by `import paddle`: no rpath), the custom-device code paths of the headers
kernel_flags=(-O2 -std=c++17 -shared -fPIC -pthread -DPADDLE_WITH_CUSTOM_KERNEL -DPADDLE_WITH_CUSTOM_DEVICE -w)
hash=$( (cat "${sources[@]}" "${kernel_sources[@]}" "$header"; echo "${flags[*]} ${kernel_flags[*]} $paddle_version"
         "$cxx" --version | head -1) | sha256sum | cut -c1-12)
dir="$cache/paddle$paddle_version-$python_tag-$hash"

build() {
  echo "fake_device.sh: building the fake accelerator into $dir" >&2
  "$cxx" "${flags[@]}" -I"$include" "${sources[@]}" -o "$1/libfakedev.so" >&2
  mkdir "$1/kernels"
  cp "$1/libfakedev.so" "$1/kernels/libfakedev.so"
  "$cxx" "${kernel_flags[@]}" -I"$include" -I"$include/third_party" "${kernel_sources[@]}" \
    -L"$(dirname "$paddle_lib")" -l:libpaddle.so -o "$1/kernels/libfakedev_kernels.so" >&2
}
source "$here/scripts/_build_once.sh"
build_once "$dir" kernels/libfakedev_kernels.so build
echo "CUSTOM_DEVICE_ROOT=$dir"
echo "DEVICE=fakedev"
