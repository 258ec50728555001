"""`python tests/fault_cli.py N ARGS...` = `python -m codegen ARGS`, killed (exit 137, no cleanup) right after
its N-th file operation. The hook is injected here, by the test side; codegen itself never reads it."""

from __future__ import annotations

import os
import sys

import codegen.modeldir.transaction


def install_fault(after: int) -> None:
    """Kill this process after `after` file operations (codegen.modeldir.transaction calls the hook after each one)."""
    ops = [0]

    def hook() -> None:
        ops[0] += 1
        if ops[0] >= after:
            os._exit(137)

    codegen.modeldir.transaction.step_hook = hook


if __name__ == "__main__":
    install_fault(int(sys.argv[1]))
    from codegen.cli import main

    sys.exit(main(sys.argv[2:]))
