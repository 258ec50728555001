"""The hidden `python -m codegen` subcommands a local rank runs: codegen.ranks starts them, the CLI dispatches them.

Standard library only, and nothing else in it: the CLI imports it for every command (patch included), so naming a
rank's subcommand must not import the harness or the serving stack.
"""

from __future__ import annotations

#: every rank of a harness launch (verify, bench, demo): codegen.harness.worker.main
WORKER = "_worker"
#: every rank of `serve` / `generate`: codegen.serve.rank
SERVE_RANK = "_serve"
