#!/usr/bin/env bash
# The test command (README, CI): both pinned environments, real processes, real DeepSpeed.
#   transformers latest (constraints/latest.txt): the whole suite;
#   transformers 4.57.6: everything whose answer depends on the installed transformers (loader, runtime,
#   CLI, and the regression test that reads the installed sources). The rest of the regression matrix
#   reads pinned wheels only, and the `once` tests exercise the harness itself: both run in the first env.
# Caches shared by every clone (~/.cache/codegen, or $CODEGEN_CACHE): the pinned upstream wheels
# (codegen.upstream) and DeepSpeed's JIT-built CPU all-reduce (codegen.runtime.preload_shm_op).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv constraints/latest.txt
bash scripts/setup.sh .venv-tf4 constraints/transformers-4.57.6.txt
export PYTHONDONTWRITEBYTECODE=1
echo "== transformers $(.venv/bin/python -c 'import transformers; print(transformers.__version__)'): full suite"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
echo "== transformers $(.venv-tf4/bin/python -c 'import transformers; print(transformers.__version__)'): loader, runtime, CLI, installed sources"
.venv-tf4/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
    -m "(loader or runtime or cli or installed_transformers) and not once" "$@"
