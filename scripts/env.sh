#!/usr/bin/env bash
# Usage: scripts/env.sh NAME   -> prints the path of the python of environment NAME,
#                                 creating it from requirements/NAME.txt when it does not exist yet.
#        scripts/env.sh --root -> prints the folder that holds the environments.
# Environments live outside the clone, keyed by a hash of the pin file and the Python version, so
# re-runs (and CI re-runs on the same machine) reuse them. They hold third-party packages only:
# several clones share them, so each clone puts its own checkout first with PYTHONPATH (the
# Makefile does) and this project is never installed into them.
set -euo pipefail
root=${PFC_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/paddle_fullparam_callbacks/envs}
if [ "${1:-}" = "--root" ]; then echo "$root"; exit 0; fi
name=${1:?usage: scripts/env.sh NAME | --root}
here=$(cd "$(dirname "$0")/.." && pwd)
req="$here/requirements/$name.txt"
[ -f "$req" ] || { echo "env.sh: no pin file $req" >&2; exit 2; }
# a checkout on the path would make pip see this project as installed (its egg-info) while it resolves
unset PYTHONPATH
base_python=${PFC_BASE_PYTHON:-python3}
pyver=$("$base_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
hash=$( (cat "$req"; echo "$pyver") | sha256sum | cut -c1-12)
dir="$root/$name-$hash"
# an install of this project left in the environment (an editable one points at whichever clone made
# it) is removed: it would shadow nothing on PYTHONPATH, but nothing should import it either
stale() { compgen -G "$dir/lib/python*/site-packages/*paddle_fullparam_callbacks*" >/dev/null; }
if [ ! -f "$dir/.complete" ] || stale; then
  mkdir -p "$root"
  # one builder at a time per environment; others wait for it
  exec 9>"$dir.lock"
  flock 9
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    echo "env.sh: creating environment '$name' in $dir (a few minutes, once per pin change)" >&2
    "$base_python" -m venv "$dir"
    # pip's notes about this machine's local wheel folders are noise: show everything else
    pipq() { "$dir/bin/python" -m pip "$@" -q 2> >(grep -v "^WARNING: Location" >&2); }
    pipq install --upgrade pip
    pipq install -r "$req"
    # a pin file's '# uninstall: A B' line: packages its pins pull in that break the environment (part of the
    # file, so of its hash)
    drop=$(sed -n 's/^# uninstall: *//p' "$req" | tr '\n' ' ')
    if [ -n "${drop// /}" ]; then pipq uninstall -y $drop; fi
    touch "$dir/.complete"
  elif stale; then
    echo "env.sh: removing the install of paddle-fullparam-callbacks from environment '$name'" >&2
    "$dir/bin/python" -m pip uninstall -y -q paddle-fullparam-callbacks >&2 || true
    rm -rf "$dir"/lib/python*/site-packages/*paddle_fullparam_callbacks*
  fi
fi
echo "$dir/bin/python"
