#!/usr/bin/env bash
# The main job on the built-in example: set up, then build, patch and run every family on 2 CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv constraints/latest.txt
exec .venv/bin/python -m codegen demo "$@"
