#!/usr/bin/env bash
# Create .venv and install orch with its test extras. torch is pinned to the local CPU wheel
# (torch==2.13.0) so pip never pulls a CUDA build on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
