#!/usr/bin/env bash
# The test command (README, CI): both pinned environments, real processes, real DeepSpeed.
#   transformers latest (constraints/latest.txt): the whole suite;
#   transformers 4.57.6: everything whose answer depends on the installed transformers (loader, runtime,
#   CLI, and the regression test that reads the installed sources). The rest of the regression matrix
#   reads pinned wheels only, and the `once` tests exercise the harness itself: both run in the first env.
#   DeepSpeed 0.16.9 (the oldest the policy supports, constraints/deepspeed-oldest.txt) on 4.57.6: the policy
#   runtime, its TP runs on real ranks and the shared-memory cleanup.
# Caches shared by every clone (~/.cache/codegen, or $CODEGEN_CACHE): the pinned upstream wheels
# (codegen.upstream) and DeepSpeed's JIT-built CPU all-reduce (codegen.runtime.preload_shm_op).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv constraints/latest.txt
bash scripts/setup.sh .venv-tf4 constraints/transformers-4.57.6.txt
bash scripts/setup.sh .venv-ds-oldest constraints/deepspeed-oldest.txt
export PYTHONDONTWRITEBYTECODE=1
echo "== transformers $(.venv/bin/python -c 'import transformers; print(transformers.__version__)'): full suite"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
echo "== transformers $(.venv-tf4/bin/python -c 'import transformers; print(transformers.__version__)'): loader, runtime, CLI, installed sources"
.venv-tf4/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
    -m "(loader or runtime or cli or installed_transformers) and not once" "$@"
echo "== deepspeed $(.venv-ds-oldest/bin/python -c 'from importlib.metadata import version; print(version("deepspeed"))') (oldest supported), transformers 4.57.6: policy runtime, TP runs, shm cleanup"
.venv-ds-oldest/bin/python -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_runtime.py tests/test_policy_runtime.py tests/test_shm.py -m "not once" "$@"
