#!/usr/bin/env bash
# Usage: scripts/env.sh NAME   -> prints the path of the python of environment NAME,
# creating it from requirements/NAME.txt when it does not exist yet.
# Environments live outside the clone, keyed by a hash of the pin file and the Python
# version, so re-runs (and CI re-runs on the same machine) reuse them.
set -euo pipefail
name=$1
here=$(cd "$(dirname "$0")/.." && pwd)
req="$here/requirements/$name.txt"
[ -f "$req" ] || { echo "env.sh: no pin file $req" >&2; exit 2; }
base_python=${PFC_BASE_PYTHON:-python3}
pyver=$("$base_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
hash=$( (cat "$req"; echo "$pyver") | sha256sum | cut -c1-12)
root=${PFC_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/paddle_fullparam_callbacks/envs}
dir="$root/$name-$hash"
if [ ! -f "$dir/.complete" ]; then
  mkdir -p "$root"
  # one builder at a time per environment; others wait for it
  exec 9>"$dir.lock"
  flock 9
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    echo "env.sh: creating environment '$name' in $dir (a few minutes, once per pin change)" >&2
    "$base_python" -m venv "$dir"
    # pip's notes about this machine's local wheel folders are noise: show everything else
    pipq() { "$dir/bin/python" -m pip install -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
    pipq --upgrade pip
    pipq -r "$req"
    touch "$dir/.complete"
  fi
fi
echo "$dir/bin/python"
