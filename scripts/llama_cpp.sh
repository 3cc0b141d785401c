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
converter="$dir/convert_hf_to_gguf.py"

if [ ! -f "$converter" ]; then
  mkdir -p "$cache"
  exec 9>"$dir.lock"
  flock 9
  if [ ! -f "$converter" ]; then
    echo "llama_cpp.sh: fetching llama.cpp's converter (llama-cpp-python $VERSION's sdist, 77 MB) into $dir" >&2
    tmp=$(mktemp -d "$dir.tmp.XXXXXX")
    chmod 755 "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    echo "llama-cpp-python==$VERSION --hash=sha256:$SHA256" > "$tmp/pin.txt"
    # pip prepares the sdist's metadata (its build backend, in an isolated build environment) before
    # saving it; nothing is compiled
    (unset PYTHONPATH; "$py" -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$tmp/pin.txt" \
       -d "$tmp/sdist" 2> >(grep -v "^WARNING: Location" >&2)) >&2
    top="llama_cpp_python-$VERSION/vendor/llama.cpp"
    tar -xzf "$tmp/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$tmp" --strip-components=3 \
      "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" "$top/LICENSE"
    rm -rf "$tmp/sdist" "$tmp/pin.txt"
    # the folder appears complete or not at all
    rm -rf "$dir"
    mv -T "$tmp" "$dir"
    trap - EXIT
  fi
fi
echo "$converter"
