"""Which modeling source to rewrite: `--source`, the remote code shipped in the dir, or installed transformers.

Resolution never imports transformers or the model code: it only locates files (importlib's finder)
and reads versions from package metadata, so a broken or hostile source is never executed.
"""

from __future__ import annotations

import hashlib
import functools
import importlib.util
import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from codegen.errors import BadInput, BadSource
from codegen.families import Family
from codegen.modeldir.layout import PATCHED_SUFFIX, POLICY_FILE

#: module names codegen writes itself (autotp_policy.py): remote code may not claim them
RESERVED_MODULES = frozenset({POLICY_FILE.removesuffix(".py")})


@dataclass(frozen=True)
class ModelSource:
    """The modeling source picked for a dir, and where its patched copy goes."""

    family: Family
    #: where the text came from (for the manifest and messages)
    origin_path: str
    #: "builtin" (installed transformers), "remote" (shipped in the dir) or "override" (--source)
    kind: str
    text: str
    #: the file name the patched source gets in the model dir
    output_name: str
    #: absolute package for relative imports
    package: str
    #: module names shipped in the model dir that relative imports may keep pointing at
    shipped_modules: frozenset[str]
    transformers_version: str | None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def module_name(self) -> str:
        return self.output_name.removesuffix(".py")


@functools.lru_cache(maxsize=1)
def installed_transformers_version() -> str | None:
    """The importable transformers' release, read from its `__init__.py` without importing it (and without
    importlib.metadata, whose import alone costs `patch --check` a fifth of a second)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    version = transformers_version_of(Path(spec.origin))
    if version is not None:
        return version
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def remote_module(config: Mapping) -> str | None:
    """The module a hub-style `auto_map` loads the causal LM from, if the dir ships remote code."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict):
        return None
    ref = auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoModel")
    if ref is None:
        return None
    if not isinstance(ref, str) or "." not in ref:
        raise BadInput(f"config.json auto_map entry {ref!r} is not 'module.Class': fix auto_map in config.json")
    if "--" in ref:
        raise BadInput(
            f"config.json auto_map points at code in another repository ({ref!r}): "
            "download that modeling file into the model dir first"
        )
    module = ref.rsplit(".", 1)[0]
    if not (module.isascii() and module.isidentifier()) or keyword.iskeyword(module):
        raise BadInput(f"config.json auto_map module {module!r} is not a Python module name: fix auto_map")
    if module in RESERVED_MODULES:
        raise BadInput(f"config.json auto_map module {module!r} clashes with the file codegen writes: rename it")
    return module


def resolve_source(
    family: Family,
    original_config: Mapping,
    read_original: "callable[[str], bytes | None]",
    shipped: frozenset[str],
    override: Path | None,
) -> ModelSource:
    """Pick the source to rewrite; `read_original(name)` gives a dir file as it was before any patch."""
    version = installed_transformers_version()
    remote = remote_module(original_config)
    if override is not None:
        if not override.is_file():
            raise BadSource(f"--source {override}: no such file")
        text = _read_text(override)
        output = f"{remote}{PATCHED_SUFFIX}.py" if remote else f"modeling_{family.model_type}.py"
        return ModelSource(family, str(override), "override", text, output, _package_of(override, family),
                           shipped, transformers_version_of(override))
    if remote is not None:
        name = f"{remote}.py"
        data = read_original(name)
        if data is None:
            raise BadSource(
                f"config.json auto_map names {name}, which is not in the model dir: copy the remote code "
                "into the dir or pass --source FILE"
            )
        return ModelSource(family, name, "remote", _decode(data, name), f"{remote}{PATCHED_SUFFIX}.py",
                           f"transformers.models.{family.model_type}", shipped, version)
    if version is None:
        raise BadSource(
            "transformers is not installed and the dir ships no remote code: pip install transformers, "
            "or pass --source FILE"
        )
    path = builtin_source_path(family)
    if path is None:
        raise BadSource(
            f"transformers {version} does not ship {family.builtin_module}: install a release that does "
            f"({', '.join(v for v in family.known_good if v[0].isdigit())}) or pass --source FILE"
        )
    return ModelSource(family, str(path), "builtin", _read_text(path), path.name, family.builtin_module.rsplit(".", 1)[0],
                       frozenset(), version)


def resolve_text_source(family: Family, source: ModelSource) -> ModelSource | None:
    """A multimodal wrapper whose text decoder is another family's module (codegen.families Wrapper.text_family):
    that module, from the transformers the wrapper's own comes from; None for every other family."""
    if family.wrapper is None or not family.wrapper.text_family:
        return None
    text = family.text_family
    if source.kind != "builtin":
        raise BadSource(
            f"{source.origin_path}: {family.model_type} builds its text decoder from transformers' "
            f"{text.builtin_module}; codegen patches the two built-in modules together: use the installed "
            f"transformers' (no --source, no remote code in auto_map)"
        )
    path = builtin_source_path(text)
    if path is None:
        raise BadSource(f"transformers {source.transformers_version} does not ship {text.builtin_module}, the text "
                        f"decoder of {family.model_type}: install a release that does ({', '.join(family.releases)})")
    return ModelSource(text, str(path), "builtin", _read_text(path), path.name, text.builtin_module.rsplit(".", 1)[0],
                       frozenset(), source.transformers_version)


def transformers_version_of(path: Path) -> str | None:
    """The release a file inside a transformers tree comes from (its package's `__version__`), else None."""
    for folder in path.resolve().parents:
        init = folder / "__init__.py"
        if folder.name == "transformers" and init.is_file():
            try:
                found = _VERSION.search(init.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                return None
            return found.group(1) if found else None
    return None


_VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.MULTILINE)


def builtin_source_path(family: Family) -> Path | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    parts = family.builtin_module.split(".")[1:]
    path = Path(spec.origin).parent.joinpath(*parts[:-1], parts[-1] + ".py")
    return path if path.is_file() else None


def _package_of(path: Path, family: Family) -> str:
    """A file inside a transformers tree keeps its own package; anything else is treated as the family's."""
    parts = path.resolve().parts
    if "transformers" in parts:
        i = len(parts) - 1 - parts[::-1].index("transformers")
        package = parts[i:-1]
        # the package becomes import statements: only plain identifiers, never text from an odd path
        if all(p.isascii() and p.isidentifier() and not keyword.iskeyword(p) for p in package):
            return ".".join(package)
    return f"transformers.models.{family.model_type}"


def _read_text(path: Path) -> str:
    try:
        return _decode(path.read_bytes(), str(path))
    except OSError as exc:
        raise BadSource(f"cannot read {path}: {exc.strerror}") from None


def _decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8-sig")  # a UTF-8 BOM is legal in Python source; ast/libcst want it gone
    except UnicodeDecodeError:
        raise BadSource(f"{name} is not UTF-8 text: it cannot be a modeling source") from None
