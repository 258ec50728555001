"""`patch`, `check`, `diff` and `revert` as functions returning results: the CLI only parses and prints them,
the demo and the bench call them directly.

Each raises a codegen.errors.CodegenError (one line, a documented exit code) on bad input. A model dir may
be a local path or a hub repo id (`owner/name`, resolved through the Hugging Face cache, see codegen.patch.hub);
a shared cache snapshot is never rewritten in place for an id: `patch` needs `out` then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from codegen.errors import BadInput
from codegen.families import KNOB
from codegen.modeldir.manifest import Manifest
from codegen.modeldir.directory import ModelDir
from codegen.modeldir.layout import CONFIG
from codegen.patch.source import installed_transformers_version
from codegen.patch.config import canonical_model_type
from codegen.versions import release_of

PATCH_HINT = "python -m codegen patch"


@dataclass
class PatchResult:
    """What `patch` did."""

    model_dir: Path
    #: False when the dir was already up to date (nothing written)
    changed: bool
    family: str
    coalesce: bool
    written: list[str] = field(default_factory=list)
    #: one-line notes worth telling the user (canonical model_type, quantization, --source release)
    notices: list[str] = field(default_factory=list)
    summary: str = ""


@dataclass
class CheckResult:
    """Whether the dir is patched and up to date, and if not, why."""

    model_dir: Path
    up_to_date: bool
    #: one line per problem (empty when up to date)
    problems: list[str] = field(default_factory=list)
    coalesce: bool | None = None
    summary: str = ""


@dataclass
class DiffResult:
    """What `patch` would change."""

    model_dir: Path
    #: a unified diff `patch -p1` applies inside the model dir ("" when up to date)
    diff: str
    notices: list[str] = field(default_factory=list)


@dataclass
class RevertResult:
    """What `revert` restored."""

    model_dir: Path
    was_patched: bool
    restored: list[str] = field(default_factory=list)
    #: files that could not be restored byte-for-byte (a revert without `.codegen/`), one phrase each
    not_exact: list[str] = field(default_factory=list)
    summary: str = ""


# ----------------------------------------------------------------------------------------------- locating


def _locate(model_dir: Path | str, revision: str | None, local_files_only: bool) -> tuple[ModelDir, str | None]:
    """The local dir, and the repo id when `model_dir` named one."""
    from codegen.patch import hub

    text = str(model_dir)
    if hub.looks_like_repo_id(text):
        return ModelDir(hub.snapshot(text, revision, local_files_only)), text
    if revision is not None:
        raise BadInput(f"--revision applies to hub repo ids, and {text} is a local path: drop --revision")
    md = ModelDir(Path(model_dir))
    md.check_exists()
    return md, None


def _refuse_orphan(md: ModelDir) -> None:
    from codegen.modeldir.orphan import find_orphan

    if find_orphan(md) is not None:
        raise BadInput(_orphan_line(md))


def _orphan_line(md: ModelDir) -> str:
    return (f"{md.path} holds codegen's output but not its .codegen/ record (copied without hidden files?): "
            f"run `python -m codegen revert {md.path}` to get the stock dir back, then patch it again")


def _knob(coalesce: bool) -> str:
    return "knob on: one all-reduce per MoE layer" if coalesce else "knob off: stock DeepSpeed reductions"


def _up_to_date_fast(md: ModelDir, fingerprint: dict, manifest: Manifest) -> bool:
    """The inputs are those recorded and every file is as codegen last wrote it: the plan would change nothing."""
    return manifest.inputs == fingerprint and md.exactly_as_written(manifest)


def _transformers_drift(md: ModelDir, manifest: Manifest) -> str | None:
    """A dir patched from transformers' own code under another release: its modeling file refuses to load."""
    source = manifest.source
    if source is None or source.kind not in ("builtin", "override") or not source.transformers_version:
        return None
    installed = installed_transformers_version()
    if release_of(installed) == release_of(source.transformers_version):
        return None
    return (f"{md.path}: patched for transformers {source.transformers_version}, but transformers "
            f"{installed or '(none)'} is installed: the patched modeling file refuses to load; run "
            f"`{PATCH_HINT} {md.path}` again in this environment")


# ------------------------------------------------------------------------------------------------- patch


def patch(model_dir: Path | str, *, source: Path | None = None, coalesce: bool | None = None,
          out: Path | None = None, force: bool = False, revision: str | None = None,
          local_files_only: bool = False) -> PatchResult:
    """Patch `model_dir` in place (or a linked copy at `out`); idempotent. `coalesce=None` keeps the recorded
    knob (on for a first patch)."""
    from codegen.patch.plan import build_plan, resolve_inputs

    from codegen.patch import hub

    if out is None and hub.looks_like_repo_id(str(model_dir)):  # before anything is downloaded
        raise BadInput(f"{model_dir} is a hub repo id, whose Hugging Face cache snapshot codegen never rewrites in "
                       f"place: pass --out DIR for a patched copy (its weights link into the cache)")
    md, repo = _locate(model_dir, revision, local_files_only)
    if out is not None:
        if md.manifest() is not None:
            raise BadInput(f"{md.path} is itself patched: --out copies an unpatched dir (revert it first)")
        _refuse_orphan(md)
        plan = build_plan(resolve_inputs(md, source, coalesce))  # fails before anything is copied
        from codegen.modeldir.outcopy import copy_with_linked_weights

        copy_with_linked_weights(md.path, Path(out))
        target = ModelDir(Path(out))
        with target.locked():
            target.apply(plan.files, plan.manifest, None, force=force)
        return _patched(target, plan)

    with md.locked():
        manifest = md.manifest()
        if manifest is None:
            _refuse_orphan(md)
        inputs = resolve_inputs(md, source, coalesce)
        status = md.status(manifest) if manifest is not None else {}
        if manifest is not None and _up_to_date_fast(md, inputs.fingerprint, manifest):
            return _unchanged(md, inputs.family.model_type, inputs.coalesce, inputs.notices)
        plan = build_plan(inputs)
        if manifest is not None and not _stale(md, plan.files, manifest, status):
            if manifest.inputs != plan.manifest.inputs:  # same bytes, new fingerprint: later runs stay fast
                md.check_writable()
                manifest.inputs = plan.manifest.inputs
                md.transaction().write_manifest(manifest)
            return _unchanged(md, inputs.family.model_type, inputs.coalesce, inputs.notices)
        md.apply(plan.files, plan.manifest, manifest, force=force)
    return _patched(md, plan)


def _stale(md: ModelDir, planned: dict[str, bytes], manifest: Manifest | None, status: dict[str, str]) -> list[str]:
    stale = [n for n, data in planned.items() if md.current_bytes(n) != data or status.get(n) == "edited"]
    if manifest is not None:
        stale += [n for n in manifest.files if n not in planned and status.get(n) != "original"]
    return sorted(set(stale))


def _unchanged(md: ModelDir, family: str, coalesce: bool, notices: list[str]) -> PatchResult:
    return PatchResult(md.path, False, family, coalesce, [], [], f"{md.path}: unchanged ({_knob(coalesce)})")


def _patched(md: ModelDir, plan) -> PatchResult:
    rw = plan.rewrite
    named = canonical_model_type(plan.inputs.config)
    family = plan.family.model_type if named == plan.family.model_type else f"{named} (as {plan.family.model_type})"
    where = (plan.inputs.text_source or plan.source).origin_path
    summary = (f"{md.path}: patched {family} ({rw.moe_class}.forward reduces `{rw.reduced_variable}` "
               f"once, line {rw.anchor_line} of {where}); wrote {', '.join(sorted(plan.files))}")
    return PatchResult(md.path, True, plan.family.model_type, plan.inputs.coalesce, sorted(plan.files),
                       list(plan.inputs.notices), summary)


# ------------------------------------------------------------------------------------------------- check


def check(model_dir: Path | str, *, source: Path | None = None, coalesce: bool | None = None,
          revision: str | None = None, local_files_only: bool = False) -> CheckResult:
    """Is the dir patched and up to date? Read-only: one line per problem."""
    from codegen.patch.plan import build_plan, current_knob, resolve_inputs

    md, _ = _locate(model_dir, revision, local_files_only)
    with md.locked(shared=True):
        manifest = md.manifest()
        if manifest is None:
            from codegen.modeldir.orphan import find_orphan

            if find_orphan(md) is not None:
                return CheckResult(md.path, False, [_orphan_line(md)])
            build_plan(resolve_inputs(md, source, coalesce))  # a dir patch would refuse: say why instead
            return CheckResult(md.path, False, [f"{md.path}: not patched (run `{PATCH_HINT} {md.path}`)"])
        drift = _transformers_drift(md, manifest)
        if drift is not None:
            return CheckResult(md.path, False, [drift], manifest.coalesce)
        status = md.status(manifest)
        problems = []
        for name in sorted(status):
            if status[name] == "edited":
                problems.append(f"{md.path / name}: edited since patching")
        knob = current_knob(md, manifest)
        if coalesce is not None and coalesce != knob:
            problems.append(f"{md.path / CONFIG}: {KNOB} is {str(knob).lower()}, "
                            f"{'--coalesce' if coalesce else '--no-coalesce'} asks for {str(coalesce).lower()}")
        inputs = resolve_inputs(md, source, coalesce)
        if not problems and _up_to_date_fast(md, inputs.fingerprint, manifest):
            return CheckResult(md.path, True, [], knob, f"{md.path}: patched, up to date ({_knob(knob)})")
        plan = build_plan(inputs)
        for name in sorted(plan.files):
            if status.get(name) == "edited" or md.current_bytes(name) == plan.files[name]:
                continue
            if name in status and md.current_bytes(name) is None:
                why = "missing (deleted since patching, or an interrupted run): run patch"
            elif name == CONFIG and coalesce is not None and coalesce != knob:
                continue  # said above
            else:
                why = "codegen would write different content (codegen or its source changed): run patch"
            problems.append(f"{md.path / name}: {why}")
        for name in sorted(n for n in manifest.files if n not in plan.files and status.get(n) != "original"):
            problems.append(f"{md.path / name}: written by an earlier patch and no longer needed: run patch")
    if problems:
        return CheckResult(md.path, False, problems, knob)
    return CheckResult(md.path, True, [], knob, f"{md.path}: patched, up to date ({_knob(knob)})")


# -------------------------------------------------------------------------------------------------- diff


def diff(model_dir: Path | str, *, source: Path | None = None, coalesce: bool | None = None,
         revision: str | None = None, local_files_only: bool = False) -> DiffResult:
    """What `patch` would change, as a unified diff relative to the model dir; writes nothing."""
    from codegen.patch.diff import unified_diff
    from codegen.patch.plan import build_plan, resolve_inputs

    md, _ = _locate(model_dir, revision, local_files_only)
    with md.locked(shared=True):
        manifest = md.manifest()
        if manifest is None:
            _refuse_orphan(md)
        inputs = resolve_inputs(md, source, coalesce)
        if manifest is not None and _up_to_date_fast(md, inputs.fingerprint, manifest):
            return DiffResult(md.path, "", inputs.notices)
        plan = build_plan(inputs)
        parts = []
        for name in sorted(plan.files):
            current = md.current_bytes(name)
            if current != plan.files[name]:
                parts.append(unified_diff(name, current, plan.files[name]))
    return DiffResult(md.path, "".join(parts), inputs.notices)


# ------------------------------------------------------------------------------------------------ revert


def revert(model_dir: Path | str, *, force: bool = False) -> RevertResult:
    """Restore a patched dir byte-for-byte; without `.codegen/`, undo codegen's recognisable output."""
    from codegen.patch import hub

    if hub.looks_like_repo_id(str(model_dir)):
        raise BadInput(f"{model_dir}: revert works on a local dir, never on a shared Hugging Face cache snapshot")
    md = ModelDir(Path(model_dir))
    md.check_exists()
    with md.locked():
        manifest = md.manifest()
        if manifest is None:
            return _revert_orphan(md)
        restored = md.revert(manifest, force=force)
    return RevertResult(md.path, True, restored, [],
                        f"{md.path}: reverted ({', '.join(restored) or 'nothing left to restore'})")


def _revert_orphan(md: ModelDir) -> RevertResult:
    from codegen.modeldir import configjson
    from codegen.modeldir.orphan import find_orphan
    from codegen.modeldir.transaction import atomic_write

    orphan = find_orphan(md)
    if orphan is None:
        return RevertResult(md.path, False, [], [], f"{md.path}: not patched, nothing to revert")
    md.check_writable()
    tx = md.transaction()
    done = []
    try:
        if orphan.config_updates:  # config.json first: from here on the dir loads the stock code
            data = md.current_bytes(CONFIG) or b"{}"
            path = md.path / CONFIG
            mode = path.stat().st_mode & 0o7777 if not path.is_symlink() else 0o644
            atomic_write(path, configjson.edit(data, orphan.config_updates), mode | 0o200)
            done.append(CONFIG)
        for name in orphan.generated:
            tx.remove(name)
            done.append(name)
    except OSError as exc:
        from codegen.errors import IOFailure

        raise IOFailure(tx.io_message(exc, rolled_back=None)) from None
    summary = f"{md.path}: reverted codegen's output without its .codegen/ record ({', '.join(done)})"
    if orphan.not_exact:
        summary += "; not byte-for-byte: " + "; ".join(orphan.not_exact)
    return RevertResult(md.path, True, done, orphan.not_exact, summary)
