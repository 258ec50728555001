#!/usr/bin/env bash
# Create (or refresh) a pinned virtualenv with codegen installed: scripts/setup.sh [VENV] [CONSTRAINTS]
# torch==2.13.0 goes in first: a bare `torch` requirement would pull a multi-GB CUDA build.
# CODEGEN_VENV_CACHE=1 (set by .ci/run): VENV becomes a link to a virtualenv kept in codegen's cache dir
# (${CODEGEN_CACHE:-~/.cache/codegen}/venvs), keyed by the constraints, pyproject.toml and the Python, so a
# fresh clone reuses it; any change to those three installs a new one from scratch. `pip install -e .`
# still runs every time (it points the editable install at this clone).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
constraints=${2:-constraints/latest.txt}
if [[ ${CODEGEN_VENV_CACHE:-} == 1 && ! -e $venv ]]; then
    key=$(cat "$constraints" pyproject.toml <(python3 --version) | sha256sum | cut -c1-16)
    cached=${CODEGEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/codegen}/venvs/$(basename "$constraints" .txt)-$key
    [[ -x $cached/bin/python ]] || { mkdir -p "$(dirname "$cached")"; python3 -m venv "$cached"; }
    ln -s "$cached" "$venv"
fi
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
# pip writes the interpreter it runs under into every script it installs (torchrun, deepspeed): the venv's real
# path, so a cached venv's scripts run from any clone that links it
python="$(cd "$venv" && pwd -P)/bin/python"
# a cached venv's scripts installed through an older setup carry the path they were installed through (another
# clone's .venv): point every script's interpreter line at the real path too
for script in "$(dirname "$python")"/*; do
    [[ -f $script && ! -L $script ]] || continue
    IFS= read -r first < "$script" || true
    if [[ $first == '#!'*/bin/python* && $first != "#!$python" ]]; then
        sed -i "1s|.*|#!$python|" "$script"
    fi
done
"$python" -m pip install -q --disable-pip-version-check torch==2.13.0
"$python" -m pip install -q --disable-pip-version-check -c "$constraints" -e ".[test]"
