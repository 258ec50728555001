#!/usr/bin/env bash
# The test command (README, CI): both pinned environments, real processes, real DeepSpeed.
#   transformers latest (constraints/latest.txt): the whole suite;
#   transformers 4.57.6: everything that touches transformers (loader, runtime, CLI, regression).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv constraints/latest.txt
bash scripts/setup.sh .venv-tf4 constraints/transformers-4.57.6.txt
export PYTHONDONTWRITEBYTECODE=1
echo "== transformers $(.venv/bin/python -c 'import transformers; print(transformers.__version__)'): full suite"
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
echo "== transformers $(.venv-tf4/bin/python -c 'import transformers; print(transformers.__version__)'): loader, runtime, CLI, regression"
.venv-tf4/bin/python -m pytest -q -p no:cacheprovider -m "loader or runtime or cli or regression" "$@"
