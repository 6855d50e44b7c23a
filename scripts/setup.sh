#!/usr/bin/env bash
# Create .venv and install orch with its test extras. torch is pinned to the local CPU wheel
# (torch==2.13.0) so pip never pulls a CUDA build on a CPU-only machine.
# Prints one line per step and, every 5 s while pip works, what it is at; pip's whole output
# goes to .venv/setup.log (its last lines are shown when a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS

# pip_install STEP ARGS...: pip install ARGS into .venv, a progress line every 5 s.
pip_install() {
  local step=$1 began=$SECONDS pid last from next
  shift
  from=$(($(wc -l <.venv/setup.log) + 1))  # this step's lines start here
  echo "setup: $step"
  .venv/bin/python -m pip install --progress-bar off "$@" >>.venv/setup.log 2>&1 &
  pid=$!
  next=$((began + 5))
  # NOTE: checks every second (a step that is done goes on at once), prints every 5 s
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    kill -0 "$pid" 2>/dev/null || break
    [ "$SECONDS" -ge "$next" ] || continue
    next=$((next + 5))
    last=$(tail -n "+$from" .venv/setup.log \
           | grep -E '^(Collecting|Downloading|Installing|Building|Processing)' \
           | tail -1 | cut -c1-70 || true)
    echo "setup:   ... $((SECONDS - began)) s${last:+ ($last)}"
  done
  if ! wait "$pid"; then
    echo "setup: failed: $step; the last lines of .venv/setup.log:" >&2
    tail -20 .venv/setup.log >&2
    exit 1
  fi
  echo "setup:   done in $((SECONDS - began)) s"
}

if [ ! -x .venv/bin/python ]; then
  echo "setup: [1/3] creating .venv"
  python3 -m venv .venv
else
  echo "setup: [1/3] .venv exists: updating it"
fi
: >.venv/setup.log
pip_install "[2/3] installing torch==2.13.0 (CPU build; about 30 s the first time)" "torch==2.13.0"
pip_install "[3/3] installing orch and its test extras (ray, grpc, transformers, ...; about 45 s the first time)" -e ".[test]"
echo "setup: ready in $((SECONDS - START)) s: run .venv/bin/orch (see README.md)"
