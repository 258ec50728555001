#!/usr/bin/env bash
# The test command (README, CI): both pinned environments, real processes, real DeepSpeed.
#   bash scripts/test.sh          everything, as CI runs it:
#     transformers latest (constraints/latest.txt): the whole suite;
#     transformers 4.57.6: everything whose answer depends on the installed transformers (loader, runtime, CLI, and
#       the regression test that reads the installed sources); the rest of the regression matrix reads pinned wheels
#       only, and the `once` tests exercise the harness itself: both run in the first env;
#     DeepSpeed 0.16.9 (the oldest the policy supports, constraints/deepspeed-oldest.txt) on 4.57.6: the policy runtime,
#       its TP runs on real ranks and the shared-memory cleanup.
#   bash scripts/test.sh --fast   the fast tier, for checking a change while editing: the tests marked `unit` (in-process,
#     no subprocess, no ranks, no pinned wheels; every test carries exactly one tier marker, see pyproject.toml), in the
#     latest environment (.venv, set up by a first full run), on 2 workers.
# In each environment the tests that start no ranks run on 2 pytest-xdist workers; the rank launches run one at a
# time afterwards (two DeepSpeed CPU jobs at once on one host crash each other's runs).
# Caches shared by every clone (~/.cache/codegen, or $CODEGEN_CACHE): the pinned upstream wheels
# (codegen.regression) and DeepSpeed's JIT-built CPU all-reduce (codegen.harness.opcache).
set -euo pipefail
cd "$(dirname "$0")/.."
# bytecode on: pytest keeps its assertion-rewritten test modules in tests/__pycache__ (git ignores it), which
# every later pytest run, worker and environment of the same Python reuses instead of rewriting them again
unset PYTHONDONTWRITEBYTECODE
# through the venv's real path: a cached venv linked from several clones then looks the same to DeepSpeed's JIT build
# of its CPU op (its include paths), which is built once and reused instead of rebuilt in every clone
pytest() { local venv; venv=$(cd "$1" && pwd -P); shift; "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"; }
parallel=(-n 2 --dist loadgroup)
if [[ ${1:-} == --fast ]]; then
    shift
    [[ -x .venv/bin/python ]] || bash scripts/setup.sh .venv constraints/latest.txt
    pytest .venv "${parallel[@]}" -m unit "$@"
    exit
fi
bash scripts/setup.sh .venv constraints/latest.txt
bash scripts/setup.sh .venv-tf4 constraints/transformers-4.57.6.txt
bash scripts/setup.sh .venv-ds-oldest constraints/deepspeed-oldest.txt
version() { "$1/bin/python" -c "from importlib.metadata import version; print(version('$2'))"; }
echo "== transformers $(version .venv transformers): the suite, then its rank launches"
pytest .venv "${parallel[@]}" --durations=10 -m "not runtime" "$@"
pytest .venv --durations=10 -m "runtime" "$@"
echo "== transformers $(version .venv-tf4 transformers): loader, runtime, CLI, installed sources"
selected="(loader or cli or installed_transformers) and not once"
pytest .venv-tf4 "${parallel[@]}" --durations=5 -m "($selected) and not runtime" "$@"
pytest .venv-tf4 --durations=5 -m "runtime and not once" "$@"
echo "== deepspeed $(version .venv-ds-oldest deepspeed) (oldest supported), transformers 4.57.6: policy runtime, TP runs, shm cleanup"
pytest .venv-ds-oldest --durations=5 tests/test_runtime.py tests/test_policy_runtime.py tests/test_shm.py -m "not once" "$@"
