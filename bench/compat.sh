#!/usr/bin/env bash
# The test suite on the oldest torch requirements.txt claims, and on any other versions named: one line per version.
#
#   bench/compat.sh                  # the floor of requirements.txt (torch>=X)
#   bench/compat.sh 2.8.0 2.9.1      # the floor, then these
#
# Each version gets its own venv, VENVS/torch<version> (default ~/.cache/gpt2-fineweb/compat), built once from the
# package index with requirements-dev.txt but for its torch pin: the index's torch is the CUDA build (about 6 GB with
# its nvidia libraries) and runs on a CPU too. The suite's output goes to LOGS/torch<version>.log (default
# compat_logs/, kept); PYTEST_ARGS (default -q) are pytest's options, SUITE_TIMEOUT_S bounds one suite (default 4 h).
# Prints, per version: torch <version> (<what the venv holds>): <passed/failed counts> [log]
set -uo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^torch>=\([0-9][0-9.]*\).*/\1/p' requirements.txt)
if [ -z "$floor" ]; then
  echo "compat.sh: requirements.txt has no torch>=X line" >&2
  exit 2
fi
VENVS=${VENVS:-$HOME/.cache/gpt2-fineweb/compat}
LOGS=${LOGS:-compat_logs}
mkdir -p "$VENVS" "$LOGS"
requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
# requirements-dev.txt and requirements.txt without their torch lines (the version asked for replaces them)
grep -hv -e '^-r' -e '^torch' requirements.txt requirements-dev.txt > "$requirements"
status=0
for version in "$floor" "$@"; do
  venv=$VENVS/torch$version
  log=$LOGS/torch$version.log
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || { echo "torch $version: cannot make a venv in $venv"; status=1; continue; }
  fi
  if ! "$venv/bin/pip" install -q "torch==$version" -r "$requirements" > "$log.install" 2>&1; then
    echo "torch $version: install failed ($(tail -1 "$log.install")) [$log.install]"
    status=1
    continue
  fi
  holds=$("$venv/bin/python" -c 'import sys, torch; print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")')
  # the venv first on PATH: the scripts the tests start (python3, torchrun in bench/gpu_h200.sh) are the venv's too
  PATH="$venv/bin:$PATH" VIRTUAL_ENV=$venv timeout "${SUITE_TIMEOUT_S:-14400}" "$venv/bin/python" -m pytest \
      ${PYTEST_ARGS:--q} -p no:cacheprovider > "$log" 2>&1
  code=$?
  counts=$(tail -1 "$log" | sed 's/^=* *//; s/ *=*$//')
  [ "$code" -eq 124 ] && counts="timed out after ${SUITE_TIMEOUT_S:-14400} s; last line: $counts"
  echo "torch $version ($holds): $counts [$log]"
  [ "$code" -eq 0 ] || status=1
done
exit $status
