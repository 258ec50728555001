"""`python -m codegen`: patch / revert / verify / bench / demo. Behaves like black: idempotent, --check, --diff.

This module only parses arguments and prints results: the work is in codegen.api (patch / check / diff /
revert) and in the harness modules, imported when their subcommand runs. Every expected failure is one line
on stderr and a documented exit code (codegen.errors.TABLE); an unexpected one is still one line, with exit
code 70 and `--debug` to see the traceback. A subcommand is a `_add_<name>(sub)` parser plus an entry in
COMMANDS.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from codegen import __version__, errors
from codegen.errors import CodegenError

FILES_WRITTEN = """\
files patch writes into the model dir (nothing else is touched):
  <modeling>.py       the rewritten modeling source: modeling_<model_type>.py (transformers' own code), or
                      <remote module>_codegen.py next to the dir's remote code (which stays as it is)
  autotp_policy.py    the DeepSpeed AutoTP policy: autotp_policy.init_inference(model, tp_size=N)
  config.json         auto_map -> the patched module, the knob codegen_coalesce_moe_all_reduce (only these
                      keys change; key order and indentation are kept)
  .codegen/           manifest + backups of every replaced byte (revert restores the dir byte-for-byte)
"""


def _exit_table() -> str:
    return "exit codes:\n" + "".join(f"  {code:<4}{text}\n" for code, text in errors.TABLE)


def _debug_flag(parser: argparse.ArgumentParser, top: bool) -> None:
    # accepted before and after the subcommand; the subcommand's copy must not reset the top-level one
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show the traceback of an internal error (exit 70)")


def _model_dir(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR",
                        help=f"{what}: a local Hugging Face model dir (with config.json), or a hub repo id "
                             "such as Qwen/Qwen3-30B-A3B (resolved through the local HF cache)")


def _quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success (errors still go to stderr)")


def _add_patch(sub) -> None:
    p = sub.add_parser(
        "patch", help="patch a model dir (idempotent; --check / --diff only read)",
        description="Rewrite the dir's MoE modeling source so DeepSpeed AutoTP issues one all-reduce per MoE layer, "
                    "and write the AutoTP policy next to it. Running it again changes nothing.",
        epilog=FILES_WRITTEN + "\n" + _exit_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_dir(p, "the dir to patch")
    p.add_argument("--source", type=Path, help="the modeling_*.py to rewrite instead of the resolved one "
                                               "(not a modular_*.py template)")
    knob = p.add_mutually_exclusive_group()
    knob.add_argument("--no-coalesce", dest="coalesce", action="store_false", default=None,
                      help="write the config knob off (stock reductions); sticks until --coalesce")
    knob.add_argument("--coalesce", dest="coalesce", action="store_true", default=None,
                      help="write the knob on (the default for a first patch; later runs keep the recorded choice)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 with one line per problem if the dir is not patched and up to date")
    p.add_argument("--diff", action="store_true", help="write nothing; print the unified diff patch would apply "
                                                       "(`patch -p1` inside the dir applies it); exits 0")
    p.add_argument("--out", type=Path, help="write a patched copy to this new dir instead (big files are symlinks "
                                            "to the originals); required for a hub repo id")
    p.add_argument("--force", action="store_true", help="overwrite files edited since patching")
    p.add_argument("--revision", help="hub repo id only: branch, tag or commit (default: main)")
    p.add_argument("--local-files-only", action="store_true",
                   help="hub repo id only: use the local HF cache, never the network (also HF_HUB_OFFLINE=1)")
    _quiet(p)
    _debug_flag(p, top=False)


def _add_revert(sub) -> None:
    p = sub.add_parser(
        "revert", help="restore a patched dir byte-for-byte",
        description="Restore every file codegen replaced and remove what it added. Without .codegen/ (copied away), "
                    "codegen's recognisable output is undone and the files it cannot restore exactly are named.",
        epilog=_exit_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_dir(p, "the patched dir")
    p.add_argument("--force", action="store_true", help="discard edits made since patching")
    _quiet(p)
    _debug_flag(p, top=False)


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="run the patched dir on N local CPU ranks and report")
    p.add_argument("model_dir", type=Path, nargs="+", metavar="MODEL_DIR",
                   help="patched model dirs (several are verified in one launch of the ranks)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--world", type=int, default=None, help="ranks to start (default: --tp)")
    p.add_argument("--json", type=Path, help="also write the report as JSON")
    p.add_argument("--timeout", type=float, default=600.0)
    _debug_flag(p, top=False)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark stock AutoTP (a) and transformers native TP (d) vs the patched dir (b)")
    p.add_argument("--smoke", action="store_true", help="CI-sized run: tiny models, batch 1, counts only")
    p.add_argument("--size", choices=("toy", "full"), default="toy",
                   help="toy: scaled-down widths (default, 5-10 min here); full: the published widths, 2 layers (10-17 min)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="weights and activations of (a), (b), (d) (default: float32 on CPU, bfloat16 on CUDA); "
                        "the reference (c) is always float32")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--chart", type=Path)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                   help="combine `bench --json` records (one per environment) instead of running")
    _debug_flag(p, top=False)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="build, patch and run small example dirs of every family on 2 CPU ranks")
    p.add_argument("--workdir", type=Path, help="where to build the example dirs (default: a temp dir)")
    _debug_flag(p, top=False)


def _add_shm(sub) -> None:
    from codegen import shm

    _debug_flag(shm.add_parser(sub), top=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m codegen",
        description="Rewrite MoE modeling sources so DeepSpeed AutoTP issues one all-reduce per MoE layer.",
        epilog=FILES_WRITTEN + "\n" + _exit_table(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"codegen {__version__}")
    _debug_flag(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_patch, _add_revert, _add_verify, _add_bench, _add_demo, _add_shm):
        add(sub)
    return parser


def one_line(text: str) -> str:
    """Messages carry user paths and config strings: escape newlines and other controls so a line stays one."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


def _say(args: argparse.Namespace, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(one_line(message))


def _warn(message: str) -> None:
    print(one_line(f"note: {message}"), file=sys.stderr)


# ------------------------------------------------------------------------------------------- commands


def cmd_patch(args: argparse.Namespace) -> int:
    from codegen import api

    if args.out is not None and (args.check or args.diff):
        raise errors.BadInput("--out cannot be combined with --check or --diff")
    where = {"revision": args.revision, "local_files_only": args.local_files_only}
    if args.diff:
        result = api.diff(args.model_dir, source=args.source, coalesce=args.coalesce, **where)
        for notice in result.notices:
            _warn(notice)
        sys.stdout.write(result.diff)
        sys.stdout.flush()
        if args.check:
            return errors.OK if api.check(args.model_dir, source=args.source, coalesce=args.coalesce,
                                          **where).up_to_date else errors.WOULD_CHANGE
        return errors.OK
    if args.check:
        check = api.check(args.model_dir, source=args.source, coalesce=args.coalesce, **where)
        if check.up_to_date:
            _say(args, check.summary)
            return errors.OK
        for line in check.problems:
            print(one_line(line), file=sys.stderr)
        return errors.WOULD_CHANGE
    result = api.patch(args.model_dir, source=args.source, coalesce=args.coalesce, out=args.out, force=args.force,
                       **where)
    for notice in result.notices:
        _warn(notice)
    _say(args, result.summary)
    return errors.OK


def cmd_revert(args: argparse.Namespace) -> int:
    from codegen import api

    result = api.revert(args.model_dir, force=args.force)
    _say(args, result.summary)
    return errors.OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from codegen.verify import cmd_verify

    return cmd_verify(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from codegen.bench import cmd_bench

    return cmd_bench(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from codegen.demo import cmd_demo

    return cmd_demo(args)


def _cmd_shm(args: argparse.Namespace) -> int:
    from codegen import shm

    return shm.run(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "patch": cmd_patch,
    "revert": cmd_revert,
    "verify": _cmd_verify,
    "bench": _cmd_bench,
    "demo": _cmd_demo,
    "shm": _cmd_shm,
}


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # a dir name that is not valid UTF-8 must not turn a successful run into an encoding crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except CodegenError as exc:
        print(f"error: {one_line(exc.message)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: nothing half-written (re-run patch or revert to finish)", file=sys.stderr)
        return errors.INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return errors.CLOSED_PIPE
    except Exception as exc:  # noqa: BLE001 - the contract is one line, never a traceback
        if args.debug:
            raise
        print(one_line(f"internal error: {type(exc).__name__}: {exc} (re-run with --debug and report it)"),
              file=sys.stderr)
        return errors.INTERNAL


def _silence_stdout() -> None:
    """The reader went away (`| head`): point stdout at /dev/null so the final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
