"""The upstream regression matrix: pinned transformers sources, rewritten, diffed against `generated/`.

`generated/<family>/<source-id>/modeling.diff` holds the expected unified diff of the rewrite of one pinned
upstream modeling source, and `generated/<family>/autotp_policy.py` the policy `patch` writes next to it.
Upstream files are never committed: the wheels are fetched on demand (`pip download --no-deps`) into a cache
dir and the modeling file is read out of the wheel, so the fetch does not depend on the installed transformers.

    python -m codegen regression check        # exit 1 and print the diff of diffs if generated/ drifted
    python -m codegen regression regenerate   # rewrite generated/; review and commit its diff deliberately

Cache: `$CODEGEN_UPSTREAM_CACHE`, else `~/.cache/codegen/upstream` (a dir holding the pinned wheels works offline).
The expected outputs come from the code path `patch` uses: `rewrite_modeling` (the libcst rewrite, helper block and
version guard), and
`family_policy` (codegen.patch.plan).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from codegen import __version__
from codegen.errors import IOFailure
from codegen.families import FAMILIES, Family
from codegen.modeldir.layout import PATCHED_SUFFIX, POLICY_FILE
from codegen.patch.config import restore_info
from codegen.patch.plan import family_policy
from codegen.patch.diff import text_diff
from codegen.patch.rewrite import Rewrite, SourceToRewrite, rewrite_modeling, rewrite_wrapper
from codegen.patch.target import RewriteTarget
from codegen.versions import is_legacy, newest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"
REGENERATE = "python -m codegen regression regenerate"

#: Pinned transformers releases: version -> sha256 of `transformers-<version>-py3-none-any.whl` on PyPI.
RELEASES: dict[str, str] = {
    "4.36.2": "462066c4f74ee52516f12890dcc9ec71d1a5e97998db621668455117a54330f6",  # first with mixtral
    "4.40.0": "92797ec3368ed4476a053529a4039a12ad09167d9e371981dda4afb4bdf590ac",  # first with jamba, dbrx, qwen2_moe
    "4.45.0": "f04a82926676056afb3bbf4df7d76ceb1fc2b2746247a87f3f9be4674adc95d7",  # first with olmoe
    "4.45.2": "c551b33660cfc815bae1f9f097ecfd1e65be623f13c6ee0dda372bd881460210",
    "4.46.1": "f77b251a648fd32e3d14b5e7e27c913b7c29154940f519e4c8c3aa6061df0f05",  # first with phimoe (4.46.0 is yanked)
    "4.51.0": "2e6baa476735ab8adccbaee6961525a0d1ce8c21d49293af30ef5ee4b082f64d",  # first with llama4, qwen3_moe, deepseek_v3
    "4.49.0": "6b4fded1c5fee04d384b1014495b4235a2b53c87503d7d592423c06128cbbe03",  # first with granitemoeshared
    "4.51.3": "fd3279633ceb2b777013234bbf0b4f5c2d23c4626b05497691f00cfda55e8a83",  # the patch release most 4.51 users took
    "4.52.1": "604b2bb357c480dc5883b7944e8562c967f6b06f63dfb6a1c4665d13d067148f",  # first listed with granitemoehybrid (4.52.0 is yanked)
    "4.53.0": "7d8039ff032c01a2d7f8a8fe0066620367003275f023815a966e62203f9f5dd7",  # first with dots1
    "4.54.0": "c96e607f848625965b76c677b2c2576f2c7b7097c1c5292b281919d90675a25e",  # first with ernie4_5_moe, deepseek_v2, glm4_moe
    "4.54.1": "c89965a4f62a0d07009d45927a9c6372848a02ab9ead9c318c3d082708bab529",  # the patch release deepseek_v2 and glm4_moe users took
    "4.55.4": "df28f3849665faba4af5106f0db4510323277c4bb595055340544f7e59d06458",  # first with gpt_oss
    "4.56.0": "bacf539c38dd850690856881c4974321af93a22f2ee96bcc994741a2121d8e71",  # first with hunyuan_v1_moe, glm4v_moe
    "4.57.1": "b10d05da8fa67dc41644dbbf9bc45a44cb86ae33da6f9295f5fbf5b7890bd267",  # first listed with qwen3_vl_moe, qwen3_next (4.57.0 is yanked)
    "4.57.6": "4c9e9de11333ddfe5114bc872c9f370509198acf0b87a832a0ab9458e2bd0550",
    "5.0.0": "587086f249ce64c817213cf36afdb318d087f790723e9b3d4500b97832afd52d",  # first with glm4_moe_lite, minimax_m2, solar_open
    "5.1.0": "de534b50c9b2ce6217fc56421075a1734241fb40704fdc90f50f6a08fc533d59",  # first with exaone_moe
    "5.2.0": "9ecaf243dc45bee11a7d93f8caf03746accc0cb069181bbf4ad8566c53e854b4",  # first with glm_moe_dsa, qwen3_5_moe
    "5.3.0": "50ac8c89c3c7033444fb3f9f53138096b997ebb70d4b5e50a2e810bf12d3d29a",  # first with nemotron_h
    "5.4.0": "9fbe50602d2a4e6d0aa8a35a605433dfac72d595ee2192eae192590a6cc2df86",  # first with mistral4
    "5.5.0": "821a9ff0961abbb29eb1eb686d78df1c85929fdf213a3fe49dc6bd94f9efa944",  # first with gemma4
    "5.6.0": "def5aac47b28e2f1386fa64f2f458a5474ba7733ab74c1765e7c67a79d1f1cbd",  # first with hy_v3
    "5.7.0": "869660cd8fc92badc041f5551bf755a42f4b9558c93341bf3fa3eeed7065079c",  # first with laguna
    "5.8.0": "e9d2cae6d195a7e1e05164c5ebf26142a7044e4dc4267274f4809204f92827e4",  # first with deepseek_v4
    "5.9.0": "1d19509bcff7028ebc6b277d71caa712e8353778463d38764237d14b42b52788",  # first with cohere2_moe
    "5.11.0": "06d0a34eab529955f8e704b530663c7d6bd6f9c7a9e47a05cddb4a44e7b6566b",  # first with deepseek_v32, mellum
    "5.13.0": "8adbc1d20bd5463cd6876b2eb7cb31971e1065788e7dc6bc12bab597a7c504b7",  # first with mimo_v2_flash, kimi_k25
    "5.15.0": "d7f007736f67749ae9490c4f8cb5d30b452ae2d68c8675e50ba8d63ea7feb107",  # first with axk1, axk2
    "5.16.0": "2b4adda8d99bb4c1b208da5ed967e2625ad449087827a750cb3b23ce4000b139",  # first with step3p7
    "5.17.0": "78ec1ce21579b38dfb83950a0658cd119f87212a2fcfdff478096ce9d6c03801",  # first with kimi_linear, glm5_next
    # first with aria's gate_up_proj experts, and with nemotron_h_omni
    "5.18.0": "d79e5a515a572ee3deb33eb0d578be47d91e70c75d54cf21bf6eede6edef14a9",
    "5.20.0": "5f4afd201f9ae5118b006513a0f647962b531de5592043e558a66d326378685b",  # first with bailing_hybrid, kolibri1
    "5.21.0": "8803a8712932aa3441c1e8bb340e66d5e3eca079fe65d9b717ede2f3ead01c79",  # first with beam, flint
    "5.22.0": "3cca65f94b0aa33511433c7c1a661c513e4ad8bc0504cb370d181d771e7c9aa0",  # first with mistral_large4
    "5.24.0": "ff5ebedf9359f94bb63772b6380eba6e7104d010cbbb2cb82c788817ea7486f6",  # latest 5.x, the pinned one
}
#: the newest pinned release (the one the README's measured figures are from)
LATEST = newest(RELEASES)


@dataclass(frozen=True)
class Entry:
    """One upstream source of one family: where it comes from and how `patch` would see it."""

    family: str
    #: directory under generated/<family>/
    source_id: str
    #: transformers release whose wheel ships the source; None for a file of this repository
    release: str | None
    #: path inside the wheel, or relative to the repository root
    path: str
    #: absolute package relative imports resolve against
    package: str
    #: modules shipped next to the modeling file in the model dir (relative imports to them stay relative)
    shipped_modules: frozenset[str] = frozenset()
    #: a multimodal wrapper whose text decoder is another family's module: that module's path in the same wheel
    text_path: str | None = None

    @property
    def id(self) -> str:
        return f"{self.family}/{self.source_id}"

    @property
    def output_name(self) -> str:
        """The file name `patch` gives the patched source in the model dir (codegen.patch.source.resolve_source)."""
        name = self.path.rsplit("/", 1)[-1]
        if self.release is None:  # remote code `M.py` shipped in the dir is patched into a new module `M_codegen`
            return name.removesuffix(".py") + PATCHED_SUFFIX + ".py"
        return name

    @property
    def module_name(self) -> str:
        return self.output_name.removesuffix(".py")

    @property
    def origin(self) -> str:
        return f"transformers=={self.release}" if self.release else "this repository"

    @property
    def diff_path(self) -> Path:
        return GENERATED / self.family / self.source_id / "modeling.diff"

    @property
    def text_diff_path(self) -> Path:
        """The expected rewrite of the wrapper's text decoder module (written beside the wrapper's)."""
        return GENERATED / self.family / self.source_id / "text_modeling.diff"

    @property
    def legacy(self) -> bool:
        """A transformers 4.x source (the family's Legacy names apply to its policy)."""
        return is_legacy(self.release)

    @property
    def policy_path(self) -> Path:
        """Built-in sources share one policy per family; a source shipped in the model dir names its own module."""
        if self.module_name == _builtin_module_name(self.family):
            family = FAMILIES[self.family]
            if self.legacy and family.policy_layout(True) != family.policy_layout(False):  # 4.x names it its way
                return GENERATED / self.family / "transformers-4.x" / POLICY_FILE
            return GENERATED / self.family / POLICY_FILE
        return GENERATED / self.family / self.source_id / POLICY_FILE


def _builtin_module_name(family: str) -> str:
    return FAMILIES[family].builtin_module_name


def _builtin(family: str, release: str) -> Entry:
    row = FAMILIES[family]
    module = row.builtin_module
    text = row.text_family
    return Entry(
        family=family,
        source_id=f"transformers-{release}",
        release=release,
        path=module.replace(".", "/") + ".py",
        package=module.rsplit(".", 1)[0],
        text_path=text.builtin_module.replace(".", "/") + ".py" if text is not row else None,
    )


def _remote(family: str, fixture: str) -> Entry:
    """Hub-style remote code: a fixture dir shipping one `modeling_*.py` next to its configuration module."""
    folder = ROOT / "tests" / "fixtures" / fixture
    (modeling,) = sorted(folder.glob("modeling_*.py"))
    return Entry(
        family=family,
        source_id=fixture,
        release=None,
        path=modeling.relative_to(ROOT).as_posix(),
        package=FAMILIES[family].builtin_module.rsplit(".", 1)[0],
        shipped_modules=frozenset(p.stem for p in folder.glob("configuration_*.py")),
    )


#: The matrix, from the family table: every pinned release a family lists, and its remote-code fixtures.
MATRIX: tuple[Entry, ...] = tuple(
    entry
    for name, family in FAMILIES.items()
    for entry in (
        *(_builtin(name, r) for r in family.releases),
        *(_remote(name, fixture) for fixture in family.remote_code_fixtures),
    )
)


# ---------------------------------------------------------------------------------------------- fetching


class FetchFailed(IOFailure):
    """A pinned wheel could not be downloaded or read; the message is one line."""


def cache_dir() -> Path:
    env = os.environ.get("CODEGEN_UPSTREAM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "codegen" / "upstream"


def wheel_name(release: str) -> str:
    return f"transformers-{release}-py3-none-any.whl"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(release: str, cache: Path | None = None) -> Path:
    """The pinned wheel of `release` in the cache dir, downloaded with pip if it is not there yet."""
    pinned = RELEASES[release]
    cache = cache_dir() if cache is None else cache
    wheel = cache / wheel_name(release)
    if wheel.is_file() and _sha256(wheel) == pinned:
        return wheel
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchFailed(
            f"cannot create the upstream cache {cache}: {exc.strerror}; set CODEGEN_UPSTREAM_CACHE"
        ) from None
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--ignore-requires-python",
            "--disable-pip-version-check", "--quiet", f"transformers=={release}", "-d", tmp,
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchFailed(
                f"pip download transformers=={release} did not finish ({exc}); {_offline_hint(release, cache)}"
            ) from None
        got = Path(tmp) / wheel_name(release)
        if done.returncode != 0 or not got.is_file():
            lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit {done.returncode}, no {wheel_name(release)}"
            raise FetchFailed(f"pip download transformers=={release} failed: {why}; {_offline_hint(release, cache)}")
        actual = _sha256(got)
        if actual != pinned:
            raise FetchFailed(f"downloaded {wheel_name(release)} has sha256 {actual}, pinned {pinned}: refusing it")
        os.replace(got, wheel)  # atomic: concurrent runs never see a partial wheel
    return wheel


def _offline_hint(release: str, cache: Path) -> str:
    return (
        f"to work offline put {wheel_name(release)} into {cache} "
        "(or point CODEGEN_UPSTREAM_CACHE at a dir holding it)"
    )


@lru_cache(maxsize=None)
def wheel_members(release: str, cache: Path | None = None) -> frozenset[str]:
    with zipfile.ZipFile(fetch_wheel(release, cache)) as wheel:
        return frozenset(wheel.namelist())


def read_source(entry: Entry, cache: Path | None = None, path: str | None = None) -> str:
    """The unpatched text of one matrix entry (from the pinned wheel, or from this repository); `path`: another
    file of the same wheel (a wrapper's text decoder module)."""
    path = path or entry.path
    if entry.release is None:
        return (ROOT / path).read_text(encoding="utf-8")
    wheel = fetch_wheel(entry.release, cache)
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(path).decode("utf-8")
    except KeyError:
        raise FetchFailed(f"{wheel.name} does not ship {path}: fix the matrix in codegen/regression.py") from None
    except zipfile.BadZipFile:
        raise FetchFailed(f"{wheel} is not a wheel: delete it and run again") from None


# ----------------------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class Result:
    entry: Entry
    #: the source holding the MoE blocks (a wrapper's text decoder module) and its rewrite
    original: str
    rewrite: Rewrite
    #: expected files: path relative to the repository root -> text
    files: dict[str, str]
    #: a wrapper's own module (entry.path) and its rewrite, where the MoE blocks live in its text decoder's module
    wrapper_original: str | None = None
    wrapper: Rewrite | None = None

    @property
    def patched(self) -> str:
        return self.rewrite.code


def target_of(entry: Entry) -> RewriteTarget:
    """The rewrite target `patch` would build for the entry's source."""
    return RewriteTarget(FAMILIES[entry.family], entry.package, entry.shipped_modules, f"{entry.path} ({entry.origin})",
                         entry.release)


def text_target_of(entry: Entry) -> RewriteTarget:
    """The rewrite target of a wrapper's text decoder module."""
    return RewriteTarget(FAMILIES[entry.family], entry.text_path.rsplit("/", 1)[0].replace("/", "."), frozenset(),
                         f"{entry.text_path} ({entry.origin})", entry.release)


def _header(lines: list[str]) -> str:
    return "".join(f"# {line}\n".replace("# \n", "#\n") for line in lines)


def _generated_note(*what: str) -> list[str]:
    return [
        f"GENERATED by `{REGENERATE}` (codegen {__version__}): do not edit.",
        *what,
        f"To update after a deliberate change: `{REGENERATE}`, then review and commit the diff of generated/.",
    ]


def modeling_diff(entry: Entry, original: str, patched: str, path: str | None = None) -> str:
    path = path or entry.path
    output = path.rsplit("/", 1)[-1] if path != entry.path else entry.output_name
    source_sha = hashlib.sha256(original.encode("utf-8")).hexdigest()
    origin = f"the wheel of transformers=={entry.release}" if entry.release else "this repository"
    header = _header(
        _generated_note(
            f"Expected rewrite of {path} from {origin} (sha256 {source_sha}),",
            f"as `python -m codegen patch` writes it into a model dir as {output}.",
        )
    )
    return header + text_diff(original, patched, f"a/{path}", f"b/{output}")


def policy_file(entry: Entry, policy: str) -> str:
    users = ", ".join(e.source_id for e in MATRIX if e.policy_path == entry.policy_path)
    header = _header(
        _generated_note(
            f"Expected {entry.family} autotp_policy.py that `python -m codegen patch` writes next to "
            f"{entry.output_name} (sources: {users})."
        )
    )
    return header + policy


def build(entry: Entry, cache: Path | None = None) -> Result:
    """Rewrite one entry exactly as `patch` does and render its expected generated/ files (once per process)."""
    return _build(entry, cache_dir() if cache is None else cache)


@lru_cache(maxsize=None)
def _build(entry: Entry, cache: Path) -> Result:
    family = FAMILIES[entry.family]
    original = read_source(entry, cache)
    restore = restore_info(_stock_config(entry, family), family)
    policy = policy_file(entry, family_policy(family, entry.module_name, entry.legacy))
    if entry.text_path is None:
        rewrite = rewrite_modeling(original, target_of(entry), entry.release, restore)
        files = {repo_path(entry.diff_path): modeling_diff(entry, original, rewrite.code)}
        files[repo_path(entry.policy_path)] = policy
        return Result(entry, original, rewrite, files)
    # the MoE blocks are in the text decoder's module; the wrapper's own module builds it from there
    text = read_source(entry, cache, entry.text_path)
    text_module = entry.text_path.rsplit("/", 1)[-1].removesuffix(".py")
    rewrite, wrapper = rewrite_wrapper(SourceToRewrite(original, target_of(entry), entry.release),
                                       SourceToRewrite(text, text_target_of(entry), entry.release), text_module, restore)
    files = {repo_path(entry.diff_path): modeling_diff(entry, original, wrapper.code),
             repo_path(entry.text_diff_path): modeling_diff(entry, text, rewrite.code, entry.text_path),
             repo_path(entry.policy_path): policy}
    return Result(entry, text, rewrite, files, original, wrapper)


def _stock_config(entry: Entry, family: Family) -> dict:
    """The auto_map / model_type of a stock dir of this source (the marker records what patch replaces)."""
    config: dict = {"model_type": family.model_type}
    if entry.release is None:
        config["auto_map"] = {"AutoModelForCausalLM": f"{Path(entry.path).stem}.{family.auto_classes['AutoModelForCausalLM']}"}
    return config


def repo_path(path: Path) -> str:
    """`path` relative to the repository root, as generated/ files are named."""
    return path.relative_to(ROOT).as_posix()


def index_row(r: Result) -> str:
    """The entry's row of generated/README.md."""
    diff = r.files[repo_path(r.entry.diff_path)]
    plus = sum(1 for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
    minus = sum(1 for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---"))
    kind = "fused 3-D experts" if r.rewrite.fused_experts else "per-expert modules"
    return (f"| {r.entry.family} | {r.entry.source_id} | {r.entry.origin} | {r.rewrite.moe_class}.forward: "
            f"`{r.rewrite.reduced_variable}` (line {r.rewrite.anchor_line}) | {kind} | +{plus} -{minus} |")


def index_file(results: list[Result]) -> str:
    rows = [index_row(r) for r in results]
    return (
        "<!-- " + " ".join(_generated_note("Index of the upstream regression matrix.")) + " -->\n"
        "# generated/: expected rewrites of pinned upstream sources\n\n"
        "Each `<family>/<source>/modeling.diff` is the unified diff `python -m codegen patch` applies to that\n"
        "source; `autotp_policy.py` is the policy it writes beside it. The upstream files themselves are never\n"
        "committed: `codegen/regression.py` downloads the pinned wheels and `tests/test_regression.py`\n"
        f"(`pytest -m regression`) compares a fresh rewrite with these files. After a deliberate change run\n"
        f"`{REGENERATE}` and review the diff of this directory.\n\n"
        "| family | source | from | reduction after | experts | diff |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


INDEX = "generated/README.md"


def expected_paths() -> set[str]:
    """The names of every file generated/ must hold (no rewrite needed)."""
    return {repo_path(p) for entry in MATRIX
            for p in (entry.diff_path, entry.policy_path, *((entry.text_diff_path,) if entry.text_path else ()))} | {INDEX}


def expected_files(cache: Path | None = None) -> dict[str, str]:
    """Every file generated/ must hold, by path relative to the repository root."""
    results = [build(entry, cache) for entry in MATRIX]
    files: dict[str, str] = {}
    for result in results:
        for name, text in result.files.items():
            if files.setdefault(name, text) != text:
                raise AssertionError(f"{name}: matrix entries sharing it render it differently")  # pragma: no cover
    files[INDEX] = index_file(results)
    return files


def committed_files() -> dict[str, str]:
    if not GENERATED.is_dir():
        return {}
    return {
        repo_path(p): p.read_text(encoding="utf-8")
        for p in sorted(GENERATED.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def diff_of_diffs(name: str, committed: str | None, fresh: str | None) -> str:
    """How a committed generated/ file differs from a fresh rewrite (`-` committed, `+` fresh)."""
    text = text_diff(committed, fresh, f"committed/{name}", f"fresh/{name}")
    if committed is None:
        return f"missing from generated/: {name}\n{text}"
    if fresh is None:
        return f"stale in generated/ (no matrix entry produces it): {name}\n{text}"
    return text


def drift(cache: Path | None = None) -> str:
    """The diff of diffs between generated/ and a fresh rewrite of the matrix; empty when up to date."""
    expected = expected_files(cache)
    committed = committed_files()
    return "".join(
        diff_of_diffs(name, committed.get(name), expected.get(name)) for name in sorted(set(expected) | set(committed))
        if committed.get(name) != expected.get(name)
    )


def regenerate(cache: Path | None = None) -> list[str]:
    """Rewrite generated/ from the matrix (and delete files no entry produces); returns the changed paths."""
    expected = expected_files(cache)
    committed = committed_files()
    changed = []
    for name, text in expected.items():
        if committed.get(name) != text:
            path = ROOT / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8", newline="\n")
            changed.append(name)
    for name in set(committed) - set(expected):
        (ROOT / name).unlink()
        changed.append(name)
    for directory in sorted((p for p in GENERATED.rglob("*") if p.is_dir()), reverse=True):
        if not any(directory.iterdir()):
            directory.rmdir()
    return sorted(changed)
