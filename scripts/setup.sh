#!/usr/bin/env bash
# Create (or refresh) a pinned virtualenv with codegen installed: scripts/setup.sh [VENV] [CONSTRAINTS]
# torch==2.13.0 goes in first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
constraints=${2:-constraints/latest.txt}
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
"$venv/bin/pip" install -q --disable-pip-version-check -c "$constraints" -e ".[test]"
