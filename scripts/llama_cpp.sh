#!/usr/bin/env bash
# Usage: scripts/llama_cpp.sh [--python PY]   -> prints the path of llama.cpp's convert_hf_to_gguf.py
# llama.cpp's converter is in no package of its own: llama-cpp-python's source distribution on PyPI
# carries llama.cpp (vendor/llama.cpp/), the converter and the gguf-py it imports by default included.
# The pinned sdist is downloaded once with pip (PY's, default the hf environment's: the converter runs
# there), its sha256 checked by pip (--require-hashes), and the converter's files are kept outside the
# clone, beside the environments (<env root>/../llama.cpp/<version>-<hash of the pin>/): re-runs and
# several clones reuse them. Progress goes to stderr; stdout is the one path.
set -euo pipefail
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
here=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--python" ]; then
  py=${2:?usage: scripts/llama_cpp.sh [--python PY]}
else
  py=$("$here/scripts/env.sh" hf | tail -n 1)
fi
env_root=$("$here/scripts/env.sh" --root)
cache="$(dirname "$env_root")/llama.cpp"
dir="$cache/$VERSION-$(echo "llama-cpp-python==$VERSION $SHA256" | sha256sum | cut -c1-12)"

fetch() {
  echo "llama_cpp.sh: fetching llama.cpp's converter (llama-cpp-python $VERSION's sdist, 77 MB) into $dir" >&2
  echo "llama-cpp-python==$VERSION --hash=sha256:$SHA256" > "$1/pin.txt"
  # pip prepares the sdist's metadata (its build backend, in an isolated build environment) before
  # saving it; nothing is compiled
  (unset PYTHONPATH; "$py" -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$1/pin.txt" \
     -d "$1/sdist" 2> >(grep -v "^WARNING: Location" >&2)) >&2
  local top="llama_cpp_python-$VERSION/vendor/llama.cpp"
  tar -xzf "$1/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$1" --strip-components=3 \
    "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" "$top/LICENSE"
  rm -rf "$1/sdist" "$1/pin.txt"
}
source "$here/scripts/_build_once.sh"
build_once "$dir" convert_hf_to_gguf.py fetch
echo "$dir/convert_hf_to_gguf.py"
