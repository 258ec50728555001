"""`python -m codegen`: patch / revert / verify / bench / demo. Behaves like black: idempotent, --check, --diff.

Every expected failure is one line on stderr and a documented exit code (see codegen.errors);
an unexpected one is still one line, with exit code 70 and `--debug` to see the traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from codegen import __version__, errors
from codegen.errors import CodegenError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m codegen",
        description="Rewrite MoE modeling sources so DeepSpeed AutoTP issues one all-reduce per MoE layer.",
    )
    parser.add_argument("--version", action="version", version=f"codegen {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of internal errors")
    sub = parser.add_subparsers(dest="command", required=True)

    patch = sub.add_parser("patch", help="patch a model dir (idempotent)")
    patch.add_argument("model_dir", type=Path)
    patch.add_argument("--source", type=Path, help="modeling file to rewrite instead of the resolved one")
    patch.add_argument("--no-coalesce", action="store_true", help="write the config knob off (stock reductions)")
    patch.add_argument("--check", action="store_true", help="exit 1 if the dir is not patched or has drifted")
    patch.add_argument("--diff", action="store_true", help="print the unified diff; write nothing")
    patch.add_argument("--out", type=Path, help="write a patched copy here (weight files are linked)")
    patch.add_argument("--force", action="store_true", help="overwrite files edited since patching")
    patch.add_argument("-q", "--quiet", action="store_true")

    revert = sub.add_parser("revert", help="restore a patched dir byte-for-byte")
    revert.add_argument("model_dir", type=Path)
    revert.add_argument("--force", action="store_true", help="discard edits made since patching")
    revert.add_argument("-q", "--quiet", action="store_true")

    verify = sub.add_parser("verify", help="run the patched dir on N local CPU ranks and report")
    verify.add_argument("model_dir", type=Path)
    verify.add_argument("--tp", type=int, default=2)
    verify.add_argument("--world", type=int, default=None, help="ranks to start (default: --tp)")
    verify.add_argument("--json", type=Path, help="also write the report as JSON")
    verify.add_argument("--timeout", type=float, default=600.0)

    bench = sub.add_parser("bench", help="benchmark stock AutoTP vs the patched dir")
    bench.add_argument("--smoke", action="store_true", help="CI-sized run: tiny models, counts only")
    bench.add_argument("--json", type=Path)
    bench.add_argument("--markdown", type=Path)
    bench.add_argument("--chart", type=Path)
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--tp", type=int, default=2)
    bench.add_argument("--workdir", type=Path)
    bench.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                       help="combine `bench --json` records (one per environment) instead of running")

    demo = sub.add_parser("demo", help="build, patch and run small example dirs of both families on 2 CPU ranks")
    demo.add_argument("--workdir", type=Path, help="where to build the example dirs (default: a temp dir)")
    return parser


def one_line(text: str) -> str:
    """Messages carry user paths and config strings: escape newlines and other controls so a line stays one."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # a dir name that is not valid UTF-8 must not turn a successful run into an encoding crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = _parser().parse_args(argv)
    try:
        if args.command == "patch":
            return cmd_patch(args)
        if args.command == "revert":
            return cmd_revert(args)
        if args.command == "verify":
            from codegen.verify import cmd_verify

            return cmd_verify(args)
        if args.command == "bench":
            from codegen.bench import cmd_bench

            return cmd_bench(args)
        if args.command == "demo":
            from codegen.demo import cmd_demo

            return cmd_demo(args)
    except CodegenError as exc:
        print(f"error: {one_line(exc.message)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: nothing half-written (re-run patch or revert to finish)", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the contract is one line, never a traceback
        if args.debug:
            raise
        print(one_line(f"internal error: {type(exc).__name__}: {exc} (re-run with --debug and report it)"),
              file=sys.stderr)
        return errors.INTERNAL
    return errors.OK


def _say(args: argparse.Namespace, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(one_line(message))


def cmd_patch(args: argparse.Namespace) -> int:
    from codegen.modeldir import ModelDir, copy_with_linked_weights
    from codegen.plan import make_plan, unified_diff

    if args.out is not None and (args.check or args.diff):
        raise errors.BadInput("--out cannot be combined with --check or --diff")
    src = ModelDir(args.model_dir)
    src.check_exists()
    if args.out is not None:
        if src.manifest() is not None:
            raise errors.BadInput(f"{src.path} is itself patched: --out copies an unpatched dir (revert it first)")
        make_plan(src, args.source, coalesce=not args.no_coalesce)  # fail before copying anything
        copy_with_linked_weights(args.model_dir, args.out)
        target = ModelDir(args.out)
    else:
        target = src

    with target.locked():
        plan = make_plan(target, args.source, coalesce=not args.no_coalesce)
        manifest = target.manifest()
        status = target.status(manifest) if manifest else {}
        current = {name: target.current_bytes(name) for name in plan.files}
        stale = [name for name, data in plan.files.items() if current[name] != data or status.get(name) == "edited"]
        if manifest is not None:
            stale += [n for n in manifest["files"] if n not in plan.files and status.get(n) != "original"]
        symlinked = [n for n in plan.files if (target.path / n).is_symlink()]
        stale += [n for n in symlinked if n not in stale]
        up_to_date = manifest is not None and not stale

        if args.diff:
            for name in sorted(plan.files):
                if current[name] != plan.files[name]:
                    sys.stdout.write(unified_diff(name, current[name], plan.files[name]))
            return errors.WOULD_CHANGE if (args.check and not up_to_date) else errors.OK
        if args.check:
            if up_to_date:
                _say(args, f"{target.path}: patched, up to date")
                return errors.OK
            if manifest is None:
                print(one_line(f"{target.path}: not patched"), file=sys.stderr)
            for name in sorted(set(stale)):
                why = {"edited": "edited since patching", "original": "not patched yet (interrupted run?)"}
                print(one_line(f"{target.path / name}: {why.get(status.get(name), 'codegen would write different content')}"),
                      file=sys.stderr)
            return errors.WOULD_CHANGE
        if up_to_date:
            _say(args, f"{target.path}: unchanged")
            return errors.OK
        target.apply(plan.files, plan.manifest_info, manifest, force=args.force)
    _say(
        args,
        f"{target.path}: patched {plan.family.model_type} ({plan.rewrite.moe_class}.forward reduces "
        f"`{plan.rewrite.reduced_variable}` once, line {plan.rewrite.anchor_line} of {plan.source.origin_path}); "
        f"wrote {', '.join(sorted(plan.files))}",
    )
    return errors.OK


def cmd_revert(args: argparse.Namespace) -> int:
    from codegen.modeldir import ModelDir

    md = ModelDir(args.model_dir)
    md.check_exists()
    with md.locked():
        manifest = md.manifest()
        if manifest is None:
            _say(args, f"{md.path}: not patched, nothing to revert")
            return errors.OK
        restored = md.revert(manifest, force=args.force)
    _say(args, f"{md.path}: reverted ({', '.join(restored) or 'nothing left to restore'})")
    return errors.OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
