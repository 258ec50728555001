"""Nothing is lost under interruption, failing writes, concurrency or drift.

Kills: `fault_cli.install_fault(N)` injects a hook that makes a run `os._exit(137)` right after its N-th file
operation (`python tests/fault_cli.py N ARGS` for a real process); every N is tried until the run completes. Runs are forked children of the test process: a real process dies and the
test survives, and a child may monkeypatch os.write & co. to fail (disk full, permissions) without touching
pytest. The libcst rewrite is a pure function of the source text, so the parent memoises it before forking
and a sweep of hundreds of runs stays fast; end-to-end checks use real `python -m codegen` processes.

After each kill the dir must load exactly as one of the states the run went between (config.json and every
file it loads byte-identical; unreferenced extra files allowed) -- for a first patch: as before, or fully
patched with `patch --check` passing -- never touch a file it has no business touching (weights, remote code,
Hugging Face `blobs/`), and from there `revert` must restore the original byte-for-byte and `patch` must
finish (`--check` passes), both without `--force`.

The sweeps are shared with test_reliability_report.py, which adds them up (see `outcome`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import codegen.cli  # noqa: F401 - imported once here, so forked runs start warm
import codegen.patch.rewrite  # noqa: F401
from conftest import CORPORA, ROOT, run_codegen, tree_digest

pytestmark = pytest.mark.process  # forks / starts processes: not in the fast tier

HUB_FIXTURE = ROOT / "tests" / "fixtures" / "hub_deepseek"
FAULT_CLI = ROOT / "tests" / "fault_cli.py"
KNOB = "codegen_coalesce_moe_all_reduce"

# ------------------------------------------------------------------------------------------- model dirs

QWEN_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "5.24.0",
}
HUB_DEEPSEEK_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
    "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV2Config",
        "AutoModel": "modeling_deepseek.DeepseekV2Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
    },
}


def build(kind: str, d: Path, config: dict | None = None) -> Path:
    """A model dir as `patch` sees it (config, remote code, a stand-in weights file); no torch needed."""
    d.mkdir(parents=True)
    if kind == "qwen2_moe":
        config = dict(QWEN_CONFIG) if config is None else config
    elif kind == "hub_deepseek":
        config = dict(HUB_DEEPSEEK_CONFIG) if config is None else config
        for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
            shutil.copyfile(HUB_FIXTURE / name, d / name)
    elif kind == "deepseek_v2":  # the built-in transformers implementation
        config = {k: v for k, v in HUB_DEEPSEEK_CONFIG.items() if k != "auto_map"} if config is None else config
    else:
        raise ValueError(kind)
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (d / "generation_config.json").write_text('{\n  "bos_token_id": 0,\n  "eos_token_id": 1\n}\n')
    (d / "model.safetensors").write_bytes(hashlib.sha256(kind.encode()).digest() * 128)
    return d


def build_hf_cache(kind: str, root: Path) -> Path:
    """`root/blobs/<sha>` + two revisions `root/snapshots/rev{1,2}/<name>` -> `../../blobs/<sha>`; returns rev1."""
    src = build(kind, root / "_src")
    (root / "blobs").mkdir()
    for rev in ("rev1", "rev2"):
        (root / "snapshots" / rev).mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, root / "blobs" / digest)
        for rev in ("rev1", "rev2"):
            (root / "snapshots" / rev / f.name).symlink_to(f"../../blobs/{digest}")
    shutil.rmtree(src)
    return root / "snapshots" / "rev1"


def make_layout(kind: str, layout: str, root: Path) -> tuple[Path, Path]:
    """(root to snapshot and compare, model dir to patch)."""
    if layout == "plain":
        return root, build(kind, root)
    if layout == "hf_cache":
        root.mkdir(parents=True)
        return root, build_hf_cache(kind, root)
    raise ValueError(layout)


# ----------------------------------------------------------------------------------------- fast, forked CLI

_REWRITES: dict = {}


def _memo_rewrite(text, target, block, version_guard=None):
    from codegen.patch import rewrite

    key = (text, target.package, target.shipped_modules, target.display_name, target.transformers_version,
           target.family.model_type, block, version_guard)
    if key not in _REWRITES:
        _REWRITES[key] = _REAL_REWRITE.get("fn", rewrite.rewrite_source)(text, target, block, version_guard)
    return _REWRITES[key]


#: the real rewrite, kept before any test memoises it
_REAL_REWRITE: dict = {}


@pytest.fixture
def fast(monkeypatch):
    """Memoise the libcst rewrite in this process (forked runs inherit what the parent has computed)."""
    memoise_rewrite(monkeypatch.setattr)


def memoise_rewrite(setattr_) -> None:
    """Point codegen.patch.rewrite's `rewrite_source` at the memoised one (with `setattr_`, e.g. monkeypatch's)."""
    import codegen.patch.rewrite

    _REAL_REWRITE.setdefault("fn", codegen.patch.rewrite.rewrite_source)
    setattr_(codegen.patch.rewrite, "rewrite_source", _memo_rewrite)


def warm(d: Path, *args: str) -> None:
    """Compute the plan once in the parent, so forked children find the rewrite memoised."""
    from codegen.modeldir.directory import ModelDir
    from codegen.patch.plan import make_plan

    source = Path(args[args.index("--source") + 1]) if "--source" in args else None
    make_plan(ModelDir(d), source, coalesce="--no-coalesce" not in args)


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def cli(*args, fault: int | None = None, setup=None, stdout_errors: str = "surrogateescape") -> Run:
    """`python -m codegen ARGS` in a forked child: `fault=N` kills it after its N-th file operation;
    `setup()` runs in the child first (to make writes fail there, and only there)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 99
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                # as under a C.UTF-8 locale (this CI); see test_injection for a strict-stdout locale
                sys.stdout = open(1, "w", encoding="utf-8", errors=stdout_errors, closefd=False)
                sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
                if fault is not None:
                    from fault_cli import install_fault

                    install_fault(fault)
                if setup is not None:
                    setup()
                from codegen.cli import main

                code = main([str(a) for a in args])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 2
            except BaseException:  # noqa: BLE001 - a traceback is a finding: exit 99 with it on stderr
                traceback.print_exc()
                code = 99
            finally:
                with contextlib.suppress(BaseException):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return Run(os.waitstatus_to_exitcode(status), out.read().decode("utf-8", "replace"),
                   err.read().decode("utf-8", "replace"))


def listing(d: Path) -> list[str]:
    """Every path under d, directories included (tree_digest sees files and symlinks only)."""
    return sorted(str(Path(r, n).relative_to(d)) for r, dirs, files in os.walk(d) for n in dirs + files)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# --------------------------------------------------------------------------------------------- the oracle


@dataclass
class Ref:
    """A state a dir may be left in: the digest of its files and which of them loading reads."""

    name: str
    digest: dict[str, str]
    loaded: set[str]
    check_args: tuple[str, ...] | None = None  # `patch --check ARGS` must pass in this state


def loaded_files(d: Path) -> set[str]:
    """What `from_pretrained(d, trust_remote_code=True)` + the policy read: config.json, the modules its
    auto_map names, autotp_policy.py if the state has one, and every non-Python top-level file."""
    names = {"config.json"}
    try:
        config = json.loads((d / "config.json").read_bytes())
    except (OSError, ValueError):
        config = {}
    for ref in (config.get("auto_map") or {}).values():
        if isinstance(ref, str) and "." in ref:
            names.add(ref.rsplit(".", 1)[0] + ".py")
    if (d / "autotp_policy.py").exists():  # the patched state's policy; before patching nothing loads it
        names.add("autotp_policy.py")
    names |= {p.name for p in d.iterdir() if not p.name.startswith(".") and not p.name.endswith(".py")}
    return names


def ref_of(name: str, d: Path, check_args: tuple[str, ...] | None = None) -> Ref:
    return Ref(name, tree_digest(d), loaded_files(d), check_args)


def loads_as(d: Path, ref: Ref) -> bool:
    now = tree_digest(d)
    return all(now.get(n) == ref.digest.get(n) for n in ref.loaded)


@dataclass
class Tally:
    tried: int = 0  # cases run
    failed: int = 0  # cases with at least one problem
    problems: list[str] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def case(self):
        """Count one case; it failed if it added problems."""
        self.tried += 1
        before = len(self.problems)
        yield
        self.failed += len(self.problems) > before

    def add(self, other: "Tally") -> None:
        self.tried += other.tried
        self.failed += other.failed
        self.problems += other.problems
        for k, v in other.states.items():
            self.states[k] = self.states.get(k, 0) + v


def assert_clean(tally: Tally) -> None:
    assert tally.tried > 0
    assert not tally.problems, "\n".join(tally.problems)


def untouchable(root: Path, d: Path, pristine: dict[str, str], writable: set[str]) -> dict[str, str]:
    """Entries under root that no run may change: everything but the dir's config.json and generated files."""
    prefix = "" if root == d else str(d.relative_to(root)) + "/"
    return {k: v for k, v in pristine.items()
            if not (k.startswith(prefix) and k[len(prefix):].split("/")[0] in writable)}


def recover(state_root: Path, d_rel: str, work: Path, pristine_root: dict[str, str], patch_args, label) -> list[str]:
    """From a (killed) state: `revert` restores everything byte-for-byte; `patch` finishes and checks."""
    problems = []
    a = copy_tree(state_root, work / "revert")
    r = cli("revert", a / d_rel)
    if r.rc != 0 or tree_digest(a) != pristine_root:
        problems.append(f"{label}: revert from here: rc={r.rc} {r.err.strip()[-200:]}; "
                        f"restored={tree_digest(a) == pristine_root}")
    b = copy_tree(state_root, work / "patch")
    r = cli("patch", *patch_args, b / d_rel)
    if r.rc != 0:
        problems.append(f"{label}: patch from here: rc={r.rc} {r.err.strip()[-200:]}")
    else:
        c = cli("patch", "--check", *patch_args, b / d_rel)
        if c.rc != 0:
            problems.append(f"{label}: patch from here leaves --check failing: {c.err.strip()[-200:]}")
        r = cli("revert", b / d_rel)
        if r.rc != 0 or tree_digest(b) != pristine_root:
            problems.append(f"{label}: revert after patch from here: rc={r.rc}, restored={tree_digest(b) == pristine_root}")
    shutil.rmtree(a)
    shutil.rmtree(b)
    return problems


def sweep(work: Path, kind: str, layout: str, command: str, *, start: str = "pristine",
          args: tuple[str, ...] = ()) -> Tally:
    """Kill `command` (patch or revert, with `args`) after each of its file operations in turn.

    start: "pristine" (a fresh dir), "patched" (patched with defaults), "patched-no-coalesce", or
    "patched-old-layout" (patched by an older codegen that rewrote the dir's remote modeling file in place).
    """
    work.mkdir(parents=True, exist_ok=True)
    root, d = make_layout(kind, layout, work / "base")
    d_rel = str(d.relative_to(root)) if root != d else "."
    pristine_root = tree_digest(root)
    pristine = ref_of("before", d)
    refs = [pristine]
    # the final state, computed once without faults
    warm(d)
    if start == "pristine":
        pass
    elif start in ("patched", "patched-no-coalesce"):
        start_args = ("--no-coalesce",) if start == "patched-no-coalesce" else ()
        warm(d, *start_args)
        assert cli("patch", *start_args, d).rc == 0
        refs.append(ref_of("patched (start)", d, start_args))
    elif start == "patched-old-layout":
        _emulate_old_layout(d)
        refs.append(ref_of("patched by the old layout (start)", d, None))
    else:
        raise ValueError(start)
    if command == "patch":
        warm(d, *args)
    final_root = copy_tree(root, work / "final")
    final_d = final_root / d_rel
    done = cli(command, *args, final_d)
    assert done.rc == 0, done.err
    if command == "patch":
        # a first patch must end up fully patched with --check passing; a re-patch may still be tidying up
        # (restoring files the old patch wrote and this one doesn't) once the new config.json is in
        refs.append(ref_of("patched (end)", final_d, args if start == "pristine" else None))
    writable = {"config.json", "autotp_policy.py", ".codegen"}
    for state_dir in (d, final_d):
        manifest = state_dir / ".codegen" / "manifest.json"
        if manifest.exists():
            writable |= set(json.loads(manifest.read_text())["files"])
    writable |= {k.split("/")[0] for k in tree_digest(final_d)} - {k.split("/")[0] for k in pristine.digest}
    frozen = untouchable(root, d, pristine_root, writable)

    tally = Tally()
    for n in itertools.count(1):
        case_root = copy_tree(root, work / f"kill-{n}")
        case = case_root / d_rel
        run = cli(command, *args, case, fault=n)
        label = f"{kind}/{layout}: {command} {' '.join(args)} from {start}, killed after op {n}"
        if run.rc == 0:
            shutil.rmtree(case_root)
            break
        with tally.case():
            _judge_kill(tally, run, label, case, case_root, d_rel, work, frozen, refs, pristine, pristine_root,
                        args if command == "patch" else ())
        shutil.rmtree(case_root)
    return tally


def _judge_kill(tally, run, label, case, case_root, d_rel, work, frozen, refs, pristine, pristine_root, patch_args):
    """One killed run: exit 137, nothing untouchable touched, loads as a known state, recoverable."""
    if run.rc != 137:
        tally.problems.append(f"{label}: exit {run.rc}: {run.err.strip()[-300:]}")
    now_root = tree_digest(case_root)
    changed = sorted(k for k, v in frozen.items() if now_root.get(k) != v)
    if changed:
        tally.problems.append(f"{label}: changed files it must not touch: {changed}")
    matched = [ref for ref in refs if loads_as(case, ref)]
    if not matched:
        tally.problems.append(f"{label}: the dir loads as none of: {', '.join(r.name for r in refs)}")
    elif matched[-1].check_args is not None and matched[-1] is not pristine:
        check = cli("patch", "--check", *matched[-1].check_args, case)
        if check.rc != 0:
            tally.problems.append(f"{label}: loads as {matched[-1].name} but --check fails: {check.err.strip()}")
    for ref in matched[-1:]:
        tally.states[ref.name] = tally.states.get(ref.name, 0) + 1
    tally.problems += recover(case_root, d_rel, work, pristine_root, patch_args, label)


def _emulate_old_layout(d: Path) -> None:
    """What an earlier codegen left: the remote modeling file rewritten in place, auto_map unchanged."""
    assert cli("patch", d).rc == 0
    manifest_path = d / ".codegen" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    new_name = next(n for n in manifest["files"] if n.endswith("_codegen.py"))
    old_name = new_name.replace("_codegen.py", ".py")
    backup = d / ".codegen" / "originals" / old_name
    shutil.copyfile(d / old_name, backup)
    os.chmod(backup, 0o444)
    code = (d / new_name).read_bytes()
    (d / new_name).unlink()
    (d / old_name).write_bytes(code)
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {k: v.replace(new_name[:-3] + ".", old_name[:-3] + ".") for k, v in config["auto_map"].items()}
    config_bytes = (json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    (d / "config.json").write_bytes(config_bytes)
    record = manifest["files"].pop(new_name)
    manifest["files"][old_name] = {
        "original": {"kind": "file", "mode": 0o644, "sha256": hashlib.sha256(backup.read_bytes()).hexdigest()},
        "written_sha256": hashlib.sha256(code).hexdigest(),
    }
    assert record["original"] == {"kind": "absent"}
    manifest["files"]["config.json"]["written_sha256"] = hashlib.sha256(config_bytes).hexdigest()
    manifest.pop("inputs", None)  # an older codegen recorded no input fingerprint
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


#: every sweep the reliability figure counts: name -> (kind, layout, command, start, args)
SWEEPS = {
    "patch-qwen2_moe-plain": ("qwen2_moe", "plain", "patch", "pristine", ()),
    "patch-hub_deepseek-plain": ("hub_deepseek", "plain", "patch", "pristine", ()),
    "patch-deepseek_v2-plain": ("deepseek_v2", "plain", "patch", "pristine", ()),
    "patch-no-coalesce-qwen2_moe-plain": ("qwen2_moe", "plain", "patch", "pristine", ("--no-coalesce",)),
    "patch-qwen2_moe-hf_cache": ("qwen2_moe", "hf_cache", "patch", "pristine", ()),
    "patch-hub_deepseek-hf_cache": ("hub_deepseek", "hf_cache", "patch", "pristine", ()),
    "revert-qwen2_moe-plain": ("qwen2_moe", "plain", "revert", "patched", ()),
    "revert-hub_deepseek-plain": ("hub_deepseek", "plain", "revert", "patched", ()),
    "revert-qwen2_moe-hf_cache": ("qwen2_moe", "hf_cache", "revert", "patched", ()),
    "revert-hub_deepseek-hf_cache": ("hub_deepseek", "hf_cache", "revert", "patched", ()),
    "repatch-no-coalesce-qwen2_moe": ("qwen2_moe", "plain", "patch", "patched", ("--no-coalesce",)),
    "repatch-coalesce-hub_deepseek": ("hub_deepseek", "hf_cache", "patch", "patched-no-coalesce", ("--coalesce",)),
    "repatch-from-old-layout-hub_deepseek": ("hub_deepseek", "plain", "patch", "patched-old-layout", ()),
}

_OUTCOMES: dict[str, Tally] = {}


def cached(name: str, compute) -> Tally:
    """A corpus' result, computed once per session (test_reliability_report.py adds them all up)."""
    if name not in _OUTCOMES:
        _OUTCOMES[name] = compute()
    return _OUTCOMES[name]


def outcome(name: str, work: Path) -> Tally:
    kind, layout, command, start, args = SWEEPS[name]
    return cached(name, lambda: sweep(work / name, kind, layout, command, start=start, args=args))


# ------------------------------------------------------------------------------------------------- kills


@pytest.mark.parametrize("name", list(SWEEPS))
@CORPORA
def test_kill_at_every_write_step_leaves_a_loadable_recoverable_dir(name, fast, tmp_path_factory):
    tally = outcome(name, tmp_path_factory.mktemp("sweep"))
    assert_clean(tally)


@CORPORA
def test_first_patch_kills_land_only_in_before_or_fully_patched(fast, tmp_path_factory):
    tally = outcome("patch-hub_deepseek-plain", tmp_path_factory.mktemp("sweep"))
    assert set(tally.states) <= {"before", "patched (end)"} and tally.states.get("before")
    # the remote modeling file the unpatched config loads is never rewritten (a new module is written)


def test_fault_hook_kills_a_real_process_and_the_next_run_finishes(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    before = tree_digest(d)
    killed = subprocess.run([sys.executable, str(FAULT_CLI), "2", "patch", str(d)], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert killed.returncode == 137, killed.stderr
    assert json.loads((d / "config.json").read_text()) == QWEN_CONFIG  # commit point not reached
    assert run_codegen("patch", d).returncode == 0
    assert run_codegen("patch", "--check", d).returncode == 0
    assert run_codegen("revert", d).returncode == 0
    assert tree_digest(d) == before


def test_leftovers_of_a_killed_run_are_removed_by_the_next_one(fast, tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    before = tree_digest(d)
    warm(d)
    assert cli("patch", d, fault=1).rc == 137  # died after backing up config.json, before the manifest
    assert (d / ".codegen").is_dir() and not (d / ".codegen" / "manifest.json").exists()
    # temp files a SIGKILL mid-write would leave (the hook only kills between operations)
    (d / ".config.json.codegen-tmp-99999").write_bytes(b"{half")
    (d / ".codegen" / ".manifest.json.codegen-tmp-99999").write_bytes(b"{half")
    r = cli("revert", d)
    assert r.rc == 0, r.err
    assert tree_digest(d) == before  # nothing left behind
    # and a state dir whose manifest vanished while backups differ from the dir is left alone
    assert cli("patch", d).rc == 0
    (d / ".codegen" / "manifest.json").unlink()
    assert cli("revert", d).rc == 0
    assert (d / ".codegen" / "originals" / "config.json").is_file()


def test_out_cleans_up_a_killed_out_runs_half_made_copy(fast, tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    before = tree_digest(d)
    warm(d)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".copy.codegen-tmp-{int(dead.stdout)}"
    (stale / "sub").mkdir(parents=True)
    (stale / "config.json").write_text("{half")
    live = tmp_path / f".copy.codegen-tmp-{os.getpid()}"  # another run still copying: left alone
    live.mkdir()
    r = cli("patch", "--out", tmp_path / "copy", d)
    assert r.rc == 0, r.err
    assert not stale.exists() and live.exists()
    assert tree_digest(d) == before  # the source dir is never touched
    assert cli("patch", "--check", tmp_path / "copy").rc == 0


# ------------------------------------------------------------------------------------------ HF cache


def test_hf_cache_snapshot_blobs_untouched_and_symlinks_restored(fast, tmp_path):
    root, d = make_layout("hub_deepseek", "hf_cache", tmp_path / "cache")
    before = tree_digest(root)
    blobs = {k: v for k, v in before.items() if k.startswith("blobs/")}
    warm(d)
    r = cli("patch", d)
    assert r.rc == 0, r.err
    after = tree_digest(root)
    assert {k: v for k, v in after.items() if k.startswith("blobs/")} == blobs
    assert {k: v for k, v in after.items() if k.startswith("snapshots/rev2/")} == \
        {k: v for k, v in before.items() if k.startswith("snapshots/rev2/")}
    assert not (d / "config.json").is_symlink()  # replaced, not written through
    assert (d / "modeling_deepseek.py").is_symlink()  # remote code the old config loads: untouched
    assert cli("patch", "--check", d).rc == 0
    assert cli("revert", d).rc == 0
    assert tree_digest(root) == before
    assert all((d / n).is_symlink() for n in ("config.json", "modeling_deepseek.py", "model.safetensors"))


# -------------------------------------------------------------------------------------------- concurrency


def test_two_real_patch_processes_at_once_one_wins_the_other_waits(tmp_path):
    d = build("hub_deepseek", tmp_path / "m")
    before = tree_digest(d)
    cmd = [sys.executable, "-m", "codegen", "patch", str(d)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0], results
    outs = sorted(out for _, out, _ in results)
    assert sum("patched deepseek_v2" in o for o in outs) == 1 and sum("unchanged" in o for o in outs) == 1, outs
    assert all("Traceback" not in err for _, _, err in results)
    assert run_codegen("patch", "--check", d).returncode == 0
    assert run_codegen("revert", d).returncode == 0
    assert tree_digest(d) == before


def test_patch_and_revert_racing_leave_one_consistent_state(fast, tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    before = tree_digest(d)
    warm(d)
    assert cli("patch", d).rc == 0
    patched = tree_digest(d)
    pids = []
    for argv in (("revert", d), ("patch", d)):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os._exit(cli(*argv).rc)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    assert codes == [0, 0]
    assert tree_digest(d) in (before, patched)


def test_lock_held_elsewhere_waits_then_says_so(fast, tmp_path, monkeypatch):
    import codegen.modeldir.directory

    d = build("qwen2_moe", tmp_path / "m")
    before = tree_digest(d)
    warm(d)
    monkeypatch.setattr(codegen.modeldir.directory, "LOCK_WAIT_S", 0.5)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another run holds it (flock is per open file description)
        t0 = time.monotonic()
        r = cli("patch", d)
        assert time.monotonic() - t0 >= 0.5
    finally:
        os.close(fd)
    assert r.rc == 4
    assert "waiting" in r.err and "locked by another codegen run" in r.lines[-1]
    assert "Traceback" not in r.err
    assert tree_digest(d) == before


# ----------------------------------------------------------------------------------------------- drift


@pytest.mark.parametrize("victim", ["config.json", "autotp_policy.py", "modeling_deepseek_codegen.py"])
def test_drift_is_reported_exactly_and_never_overwritten_without_force(fast, tmp_path, victim):
    d = build("hub_deepseek", tmp_path / "m")
    before = tree_digest(d)
    warm(d)
    assert cli("patch", d).rc == 0
    path = d / victim
    if victim == "config.json":
        config = json.loads(path.read_text())
        config["rope_theta"] = 12345.0
        path.write_text(json.dumps(config, indent=2))
    else:
        path.write_text(path.read_text() + "\n# my local tweak\n")
    edited = tree_digest(d)

    check = cli("patch", "--check", d)
    assert check.rc == 1
    assert check.lines == [f"{path}: edited since patching"]  # exactly the drifted file, nothing else

    for argv in (("patch", d), ("revert", d)):
        r = cli(*argv)
        assert r.rc == 5, r.err
        assert len(r.lines) == 1 and victim in r.err and "--force" in r.err
        assert tree_digest(d) == edited  # the edit survives

    assert cli("patch", "--force", d).rc == 0
    assert cli("patch", "--check", d).rc == 0
    path.write_text("x = 1\n") if victim != "config.json" else path.write_text("{}")
    assert cli("revert", "--force", d).rc == 0
    assert tree_digest(d) == before


def test_a_deleted_generated_file_is_recreated_not_treated_as_an_edit(fast, tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    warm(d)
    assert cli("patch", d).rc == 0
    (d / "autotp_policy.py").unlink()
    check = cli("patch", "--check", d)
    assert check.rc == 1 and "autotp_policy.py" in check.err
    assert cli("patch", d).rc == 0
    assert cli("patch", "--check", d).rc == 0


def test_a_symlink_put_where_codegen_wrote_a_file_is_an_edit(fast, tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    warm(d)
    assert cli("patch", d).rc == 0
    (d / "autotp_policy.py").unlink()
    (d / "autotp_policy.py").symlink_to("nowhere.py")  # dangling: reads as absent, but it is the user's
    r = cli("revert", d)
    assert r.rc == 5 and "autotp_policy.py" in r.err
    assert (d / "autotp_policy.py").is_symlink()


# --------------------------------------------------------------------------------- failing writes


def _fail(name: str, err: int, after: int, under: Path):
    """A setup() for cli(): `os.<name>` raises OSError(err) for paths under `under` once `after` calls passed."""

    def setup():
        real = getattr(os, name)
        calls = [0]
        prefix = str(under.resolve())

        def target_of(args):
            first = args[0]
            if name == "write":
                try:
                    return os.readlink(f"/proc/self/fd/{first}")
                except OSError:
                    return ""
            return os.fspath(first)

        def fake(*args, **kwargs):
            path = os.path.abspath(target_of(args))
            creating = name != "open" or (len(args) > 1 and args[1] & os.O_CREAT)
            if path.startswith(prefix) and creating:
                calls[0] += 1
                if calls[0] > after:
                    raise OSError(err, os.strerror(err), target_of(args))
            return real(*args, **kwargs)

        setattr(os, name, fake)

    return setup


#: (os function, errno, words in the message): full disk, missing permissions, read-only file system
FAILURES = [
    ("write", errno.ENOSPC, "disk full"),
    ("open", errno.EACCES, "permission denied"),
    ("replace", errno.EROFS, "read-only file system"),
    ("replace", errno.EPERM, "permission denied"),
]


def failing_writes(work: Path, kind: str) -> Tally:
    """`patch` on a fresh dir with each kind of write failure at each write: exit 4, one line, dir unchanged;
    `revert` of a patched dir likewise: exit 4, one line, the dir loads as patched or as before, and a
    `revert` once the failure is gone restores everything."""
    tally = Tally()
    base = build(kind, work / "base")
    pristine = tree_digest(base)
    pristine_ref = ref_of("before", base)
    warm(base)
    patched_base = copy_tree(base, work / "patched")
    assert cli("patch", patched_base).rc == 0
    patched_ref = ref_of("patched", patched_base, ())
    for (fn, err, words), command in itertools.product(FAILURES, ("patch", "revert")):
        for after in itertools.count(0):
            case = copy_tree(base if command == "patch" else patched_base, work / f"case-{fn}-{after}")
            start, start_listing = tree_digest(case), listing(case)
            r = cli(command, case, setup=_fail(fn, err, after, case))
            label = f"{kind}: {command} with os.{fn} failing {errno.errorcode[err]} after {after} writes"
            if r.rc == 0:
                shutil.rmtree(case)
                break
            with tally.case():
                _judge_failure(tally, r, label, command, case, start, start_listing, words, pristine_ref,
                               patched_ref, pristine)
            shutil.rmtree(case)
    return tally


def _judge_failure(tally, r, label, command, case, start, start_listing, words, pristine_ref, patched_ref, pristine):
    """One run whose writes failed: exit 4 and one line; patch changed nothing; revert left a loadable dir."""
    if r.rc != 4 or len(r.lines) != 1 or words not in r.err or "Traceback" in r.err:
        tally.problems.append(f"{label}: rc={r.rc} stderr={r.err.strip()[-300:]!r}")
    if command == "patch" and (tree_digest(case) != start or listing(case) != start_listing):
        tally.problems.append(f"{label}: the dir changed")
    if ".codegen-tmp-" in r.err:
        tally.problems.append(f"{label}: the message names a temp file: {r.err.strip()}")
    if command == "revert":
        if not (loads_as(case, pristine_ref) or loads_as(case, patched_ref)):
            tally.problems.append(f"{label}: loads as neither patched nor before")
        again = cli("revert", case)
        if again.rc != 0 or tree_digest(case) != pristine:
            tally.problems.append(f"{label}: revert afterwards: rc={again.rc} {again.err.strip()}")


@pytest.mark.parametrize("kind", ["qwen2_moe", "hub_deepseek"])
@CORPORA
def test_disk_full_and_permission_errors_are_one_line_and_change_nothing(fast, tmp_path_factory, kind):
    name = f"failing-writes-{kind}"
    assert_clean(cached(name, lambda: failing_writes(tmp_path_factory.mktemp(name), kind)))


def test_unwritable_dir_is_refused_before_anything_happens(fast, tmp_path):
    # tests run as root, which chmod does not stop: simulate what os.access says to a normal user
    d = build("qwen2_moe", tmp_path / "m")
    before = tree_digest(d)
    warm(d)

    def deny():
        real = os.access
        os.access = lambda p, mode, **kw: False if os.fspath(p) == str(d) else real(p, mode, **kw)

    r = cli("patch", d, setup=deny)
    assert r.rc == 4 and r.lines == [f"error: {d} is not writable: fix its permissions or use --out DIR for a patched copy"]
    assert tree_digest(d) == before


def _read_only(d: Path) -> tuple[list[str], list[str]]:
    """(how to make `d` read-only for this user, how to undo it): root ignores mode bits but not the immutable
    attribute, so as root the dir is made immutable (chattr +i); anyone else gets chmod 555."""
    if os.geteuid() != 0:
        return ["chmod", "555", str(d)], ["chmod", "755", str(d)]
    return ["chattr", "+i", str(d)], ["chattr", "-i", str(d)]


def test_read_only_dir_for_real(tmp_path):
    d = build("qwen2_moe", tmp_path / "m")
    before = tree_digest(d)
    lock, unlock = _read_only(d)
    made = subprocess.run(lock, capture_output=True, text=True)
    if made.returncode != 0:  # a container without CAP_LINUX_IMMUTABLE: nothing can make a dir read-only to root
        pytest.skip(f"cannot make a dir read-only for uid {os.geteuid()} here: {made.stderr.strip()}")
    try:
        r = run_codegen("patch", d)
        assert r.returncode == 4, r.stderr
        assert r.stderr.strip().splitlines() == [f"error: {d} is not writable: fix its permissions or use --out DIR "
                                                 "for a patched copy"]
        assert tree_digest(d) == before
    finally:
        subprocess.run(unlock, check=True)
