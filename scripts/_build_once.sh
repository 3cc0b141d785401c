# Sourced by the scripts that keep a build or a download outside the clone (fake_device.sh, llama_cpp.sh).
# build_once DIR FILE FUNCTION: unless DIR/FILE exists, runs FUNCTION TMP (TMP: a fresh folder beside DIR)
# holding DIR.lock, then puts TMP in DIR's place. Several clones or test runs may ask at once: one builds,
# the others wait for it, and the folder appears complete or not at all.
build_once() {
  local dir=$1 file=$2 fn=$3 tmp
  [ -f "$dir/$file" ] && return 0
  mkdir -p "$(dirname "$dir")"
  exec 9>"$dir.lock"
  flock 9
  if [ ! -f "$dir/$file" ]; then
    tmp=$(mktemp -d "$dir.tmp.XXXXXX")
    chmod 755 "$tmp"
    trap "rm -rf '$tmp'" EXIT
    "$fn" "$tmp"
    rm -rf "$dir"
    mv -T "$tmp" "$dir"
    trap - EXIT
  fi
  exec 9>&-
}
