"""One exception type per exit code, so every failure reaches the user as one line with a documented status."""

from __future__ import annotations

# Exit codes (documented in the README; stable, like black's).
OK = 0
WOULD_CHANGE = 1  # --check: not patched / drifted; --diff: a diff was printed
BAD_INPUT = 2  # missing dir, bad config.json, unsupported model_type, bad config values, usage
BAD_SOURCE = 3  # modeling source missing, not Python, or no recognisable MoE expert sum
IO_FAILURE = 4  # dir not writable, disk full, locked by another run
USER_EDITS = 5  # patch/revert refused: files edited since patching (use --force)
VERIFY_FAILED = 6  # verify/bench: numerics or all-reduce counts off
INTERNAL = 70  # a bug in codegen


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
