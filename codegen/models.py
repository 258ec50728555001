"""Loading a model dir with the installed transformers, the one way the harness and `serve` do it.

The auto class is the one the dir's config names (its `auto_map`, else its model type's mapping) for the class the
checkpoint was saved from (`architectures`), else the causal-LM class where there is one, else the
image-text-to-text class of a multimodal wrapper; the causal-LM class first for a wrapper whose own forward does not
run its text decoder (the family table's `Wrapper.runs_as_causal_lm`); a wrapper with no forward at all (a
multimodal-LM class only) loads whole and runs through its text submodule (`Wrapper.text_submodule`, `runs_as`): its
policy is handed the whole model and shards that submodule, the engine's module. The dtype keyword is the
installed release's (`dtype` from 4.56, `torch_dtype` before). The dir's generated policy is imported as a module.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from codegen.modeldir.layout import CONFIG, POLICY_FILE

#: auto classes tried, in order, for the model a dir holds (text only first; the last two: a wrapper with no forward,
#: as transformers 5.x and 4.x map it)
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForMultimodalLM",
                "AutoModelForTextToWaveform")


def model_config(directory: str | Path) -> dict:
    return json.loads(Path(directory, CONFIG).read_text())


def model_sizes(directory: str | Path) -> dict:
    """The decoder's sizes (vocab_size, num_hidden_layers, ...): a multimodal config nests them in its text config."""
    from codegen.families import sizes_of

    return sizes_of(model_config(directory))


def has_remote_code(directory: str | Path) -> bool:
    return bool(model_config(directory).get("auto_map"))


def dtype_keyword() -> str:
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def auto_class(directory: str | Path):
    """The transformers auto class that loads `directory`'s model with its weights."""
    import transformers
    from transformers.models.auto import modeling_auto

    config = model_config(directory)
    auto_map = config.get("auto_map") or {}
    mappings = {"AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                "AutoModelForImageTextToText": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                "AutoModelForMultimodalLM": "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
                "AutoModelForTextToWaveform": "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES"}
    classes = {}  # auto class -> the model class it loads for this dir
    for name in (n for n in AUTO_CLASSES if hasattr(transformers, n)):
        if auto_map:
            found = auto_map.get(name)
            found = found.rsplit(".", 1)[-1] if isinstance(found, str) else None
        else:
            found = getattr(modeling_auto, mappings[name], {}).get(config.get("model_type"))
        if found:
            classes[name] = found
    if "AutoModelForCausalLM" in classes and _runs_as_causal_lm(config.get("model_type")):
        return transformers.AutoModelForCausalLM
    # the class the checkpoint was saved from (a multimodal checkpoint that also loads text-only: the whole model)
    saved = (config.get("architectures") or [None])[0]
    for name, found in classes.items():
        if found == saved:
            return getattr(transformers, name)
    return getattr(transformers, next(iter(classes), "AutoModelForCausalLM"))


def _runs_as_causal_lm(model_type) -> bool:
    """A multimodal wrapper whose own forward does not run its text decoder (the family table says so)."""
    from codegen.families import family_named, normalise_model_type

    name = normalise_model_type(model_type)
    wrapper = family_named(name).wrapper if name else None
    return wrapper is not None and wrapper.runs_as_causal_lm


def dir_family(directory: str | Path):
    """The family of a dir's config.json model type (None: not one codegen knows)."""
    from codegen.families import family_named, normalise_model_type

    name = normalise_model_type(model_config(directory).get("model_type"))
    return family_named(name) if name else None


def runs_as(model):
    """The module that runs a loaded model: a wrapper with no forward of its own runs its text submodule (the family
    table's `Wrapper.text_submodule`); every other model, or that submodule itself, runs as it is."""
    from codegen.families import family_named, normalise_model_type

    name = normalise_model_type(getattr(getattr(model, "config", None), "model_type", None))
    wrapper = family_named(name).wrapper if name else None
    sub = wrapper.text_submodule if wrapper is not None else ""
    return getattr(model, sub) if sub and hasattr(model, sub) else model


def load(directory: str | Path, remote: bool, dtype, **extra):
    """The dir's model in eval mode (its patched remote code where `remote`)."""
    return auto_class(directory).from_pretrained(directory, trust_remote_code=remote, **{dtype_keyword(): dtype},
                                                 **extra).eval()


def load_policy(directory: str | Path, name: str):
    """The dir's generated autotp_policy.py, imported as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, POLICY_FILE))
    policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(policy)
    return policy
