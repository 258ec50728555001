"""One exception type per exit code, so every failure reaches the user as one line with a documented status."""

from __future__ import annotations

# Exit codes (TABLE below documents them; stable, like black's).
OK = 0
WOULD_CHANGE = 1  # patch --check: not patched / drifted / another transformers (--diff alone exits 0)
BAD_INPUT = 2  # missing dir, bad config.json, unsupported model_type, bad config values, usage
BAD_SOURCE = 3  # modeling source missing, not Python, or no recognisable MoE expert sum
IO_FAILURE = 4  # dir not writable, disk full, locked by another run
USER_EDITS = 5  # patch/revert refused: files edited since patching (use --force)
VERIFY_FAILED = 6  # verify/bench: numerics or all-reduce counts off
SERVE_FAILED = 7  # serve/generate: a rank failed (its line says why)
INTERNAL = 70  # a bug in codegen
INTERRUPTED = 130  # Ctrl-C: nothing half-written
CLOSED_PIPE = 141  # stdout closed early (`... --diff | head`): output cut short, nothing else wrong

#: the table `--help` prints and docs/usage.md carries (rendered by codegen.support; a test keeps them equal)
TABLE = (
    (OK, "done / up to date; --diff exits 0 whether or not it printed a diff (--check --diff: 1 if not up to date)"),
    (WOULD_CHANGE, "--check: not patched, edited, stale, patched under another transformers, or .codegen/ lost"),
    (BAD_INPUT, "bad input: missing dir, bad config.json or values, unsupported model_type, usage, hub id without "
                "--out, .codegen/ lost"),
    (BAD_SOURCE, "modeling source missing, not Python, a modular_*.py, already patched, or no recognisable MoE "
                 "expert sum"),
    (IO_FAILURE, "cannot write: permissions, disk full, locked by another run (nothing half-written)"),
    (USER_EDITS, "files edited since patching: re-run with --force to overwrite / discard them"),
    (VERIFY_FAILED, "verify / bench / demo: numerics or all-reduce counts off"),
    (SERVE_FAILED, "serve / generate: a rank failed (the line names it and why)"),
    (INTERNAL, "a bug in codegen (re-run with --debug for the traceback)"),
    (INTERRUPTED, "interrupted (Ctrl-C, or SIGTERM to serve / generate): nothing half-written; serve / generate "
                  "stop every rank"),
    (CLOSED_PIPE, "stdout closed early (e.g. piped into head); nothing else went wrong"),
)


class CodegenError(Exception):
    """An expected failure: its message is the single line the user sees."""

    exit_code = INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadInput(CodegenError):
    exit_code = BAD_INPUT


class BadSource(CodegenError):
    exit_code = BAD_SOURCE


class IOFailure(CodegenError):
    exit_code = IO_FAILURE


class UserEdits(CodegenError):
    exit_code = USER_EDITS


class VerifyFailed(CodegenError):
    exit_code = VERIFY_FAILED


class ServeFailed(CodegenError):
    exit_code = SERVE_FAILED
