#!/usr/bin/env bash
# The deployment recipes checked without a container tool (CI has none;
# tools/container_check.sh builds and runs the image where one exists):
#   - every path deploy/Containerfile copies or runs from the build context
#     is in the repository and not left out by .containerignore;
#   - the release tarball it unpacks (--strip-components=1 into /opt/optimd)
#     holds the binary its ENTRYPOINT runs, and that binary, started with the
#     ENTRYPOINT's own flags (its directories moved into scratch, the metrics
#     port made 0), listens, serves /metrics, and stops on its STOPSIGNAL with
#     status 0;
#   - EXPOSE names the ENTRYPOINT's metrics port;
#   - every flag the ENTRYPOINT and deploy/optimd@.service pass is one that
#     `optimd --help` lists;
#   - README's table of the daemon's flags and `optimd --help` name the same
#     flags.
set -euo pipefail
scratch="$(mktemp -d /tmp/optimd-deploy-check.XXXXXX)"
daemon=""
cleanup() {
  if [ -n "$daemon" ]; then kill -9 "$daemon" 2>/dev/null || true; fi
  rm -rf "$scratch"
}
trap cleanup EXIT
fail() {
  echo "deploy check: $*"
  exit 1
}

recipe=deploy/Containerfile
# One logical line per instruction (continuations joined, blanks squeezed),
# comments out.
sed -e '/^[[:space:]]*#/d' "$recipe" | sed -e ':a' -e '/\\$/N; s/\\\n//; ta' |
  tr -s ' \t' ' ' >"$scratch/recipe"

# Paths from the build context: COPY sources (not --from another stage) and
# the repository's scripts that RUN calls.
ignored() {  # is $1 left out by .containerignore? (its patterns are globs)
  local pattern
  while read -r pattern; do
    case "$pattern" in ''|'#'*) continue ;; esac
    pattern=${pattern#\*\*/}
    # shellcheck disable=SC2053
    [[ "$1" == $pattern || "$1" == $pattern/* || "$1" == */$pattern ]] &&
      return 0
  done <.containerignore
  return 1
}
sources=$(awk '$1 == "COPY" && $2 !~ /^--from=/ {
  for (i = 2; i < NF; ++i) print $i }' "$scratch/recipe")
[ -n "$sources" ] || fail "$recipe copies nothing from the build context"
for src in $sources; do
  [ -e "$src" ] || fail "$recipe copies $src, which is not in the repository"
done
for script in $(grep '^RUN' "$scratch/recipe" | grep -o 'tools/[A-Za-z0-9_./-]*'); do
  [ -x "$script" ] || fail "$recipe runs $script, which is not an executable here"
  if ignored "$script"; then fail ".containerignore leaves out $script"; fi
done

entrypoint=$(sed -n 's/^ENTRYPOINT[[:space:]]*//p' "$scratch/recipe")
/usr/bin/python3 -c 'import json, sys
for a in json.loads(sys.argv[1]): print(a)' "$entrypoint" >"$scratch/entrypoint"
binary=$(head -1 "$scratch/entrypoint")
stop_signal=$(sed -n 's/^STOPSIGNAL[[:space:]]*//p' "$scratch/recipe")
exposed=$(sed -n 's/^EXPOSE[[:space:]]*//p' "$scratch/recipe")
grep -q -- "--metrics_listen=.*:$exposed\$" "$scratch/entrypoint" ||
  fail "EXPOSE $exposed is not the ENTRYPOINT's metrics port"
grep -q 'tar -xzf /tmp/release/optimd-\*.tar.gz -C /opt/optimd --strip-components=1' \
  "$scratch/recipe" || fail "$recipe no longer unpacks the tarball as checked here"

# The tarball as tools/release.sh packs it in the build stage.
tarball=$(tools/release "$scratch/out" | tail -1)
mkdir "$scratch/opt"
tar -xzf "$tarball" -C "$scratch/opt" --strip-components=1
installed="$scratch/opt/${binary#/opt/optimd/}"
[ -x "$installed" ] || fail "the tarball has no ${binary#/opt/optimd/} (ENTRYPOINT $binary)"

env -u LD_LIBRARY_PATH "$installed" --help >"$scratch/help" 2>&1 || true
sed -n 's/^    --\([a-z_]*\) .*/\1/p' "$scratch/help" | sort >"$scratch/help_flags"
[ -s "$scratch/help_flags" ] || fail "optimd --help lists no flags"
flag_names() { sed -n 's/^--\([a-z_]*\)=.*/\1/p'; }
unit=deploy/optimd@.service
for flag in $(tail -n +2 "$scratch/entrypoint" | flag_names) \
    $(sed -n 's/^ExecStart=[^ ]* //p' "$unit" | tr ' ' '\n' | flag_names); do
  grep -qx "$flag" "$scratch/help_flags" ||
    fail "--$flag (in $recipe or $unit) is not a flag of optimd --help"
done
grep -o '^| `--[a-z_]*`\(, `--[a-z_]*`\)*' README.md | grep -o -- '--[a-z_]*' |
  sed 's/^--//' | sort >"$scratch/readme_flags"
diff "$scratch/readme_flags" "$scratch/help_flags" >"$scratch/flags.diff" ||
  fail "README's flag table (<) and optimd --help (>) differ: $(cat "$scratch/flags.diff")"

# The ENTRYPOINT run as the container runs it, its directories in scratch.
mkdir -m 0700 "$scratch/run" "$scratch/state"
args=()
while read -r arg; do
  arg=${arg//\/run\/optimd/$scratch/run}
  arg=${arg//\/var\/lib\/optimd/$scratch/state}
  args+=("${arg/%:$exposed/:0}")
done < <(tail -n +2 "$scratch/entrypoint")
env -u LD_LIBRARY_PATH "$installed" "${args[@]}" 2>"$scratch/log" &
daemon=$!
for _ in $(seq 200); do
  grep -q "listening on unix:$scratch/run/optimd.sock" "$scratch/log" && break
  kill -0 "$daemon" 2>/dev/null || fail "the ENTRYPOINT exited: $(cat "$scratch/log")"
  sleep 0.1
done
grep -q "listening on" "$scratch/log" || fail "the ENTRYPOINT never listened"
port=$(sed -n 's/.*metrics on http port \([0-9]*\).*/\1/p' "$scratch/log")
[ -n "$port" ] || fail "the ENTRYPOINT serves no metrics: $(cat "$scratch/log")"
/usr/bin/python3 -c 'import sys, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1],
                              timeout=10).read().decode()
assert "optimd_sessions 0" in text, text' "$port" ||
  fail "/metrics of the ENTRYPOINT's daemon"
kill -s "${stop_signal#SIG}" "$daemon"
status=0
wait "$daemon" || status=$?
daemon=""
[ "$status" = 0 ] || fail "STOPSIGNAL $stop_signal ended the daemon with $status: $(cat "$scratch/log")"
grep -q "saving 0 sessions to $scratch/state/saved" "$scratch/log" ||
  fail "the daemon did not save to the state directory: $(cat "$scratch/log")"
echo "deploy check passed"
