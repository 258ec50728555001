"""One tiny image per prompt for a multimodal wrapper's forward: the vision tower runs whole on every rank, so
the contract (one reduction per MoE layer, logits as one process) must hold with image features in the prompt too.

The pixel layout is the family's `Wrapper.image_input` kind; the number of placeholder tokens is what the
model's own `get_image_features` returns for that image (counted on the single-process reference), so the
prompt always matches the features it is given.
"""

from __future__ import annotations

import inspect

import torch

from codegen.families import (IMAGE_FLAT_PATCHES, IMAGE_PATCH_ROWS, IMAGE_POSITIONED_PATCHES, IMAGE_SIZED, IMAGE_WHOLE,
                              Family, family_named, normalise_model_type)

#: patches per side of the tiny image (a multiple of every merge size the table names)
GRID_SIDE = 4


def _pixels(family: Family, vision, batch: int, generator: torch.Generator) -> dict:
    kind = family.wrapper.image_input
    if kind in (IMAGE_WHOLE, IMAGE_SIZED):  # [batch, channels, size, size]
        channels = getattr(vision, "num_channels", 3)
        size = vision.image_size
        whole = {"pixel_values": torch.randn(batch, channels, size, size, generator=generator)}
        return whole if kind == IMAGE_WHOLE else {**whole, "image_sizes": torch.tensor([[size, size]] * batch)}
    if kind == IMAGE_POSITIONED_PATCHES:  # [batch, side*side, 3 * patch**2], (x, y) per patch
        pooling = getattr(vision, "pooling_kernel_size", 1)
        side = pooling * max(1, GRID_SIDE // pooling)  # whole pooling windows
        y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        positions = torch.stack([x.flatten(), y.flatten()], dim=-1)
        return {"pixel_values": torch.randn(batch, side * side, 3 * vision.patch_size ** 2, generator=generator),
                "image_position_ids": positions.expand(batch, -1, -1).clone()}
    grid = torch.tensor([[1, GRID_SIDE, GRID_SIDE]] * batch)
    rows = batch * GRID_SIDE * GRID_SIDE
    patch = vision.patch_size
    if kind == IMAGE_FLAT_PATCHES:  # [t*h*w, channels * temporal_patch * patch**2]
        width = getattr(vision, "in_channels", 3) * getattr(vision, "temporal_patch_size", 1) * patch * patch
        return {"pixel_values": torch.randn(rows, width, generator=generator), "image_grid_thw": grid}
    if kind == IMAGE_PATCH_ROWS:  # [t*h*w, 3, patch, patch]
        return {"pixel_values": torch.randn(rows, 3, patch, patch, generator=generator), "image_grid_thw": grid}
    raise ValueError(f"{family.model_type}: unknown image input kind {kind!r}")


def image_inputs(model, ids: torch.Tensor, family: Family | None = None) -> dict | None:
    """Forward kwargs putting one image at the start of every prompt of `ids` (None: the model's family takes no
    image): `input_ids` with the start / placeholder / end tokens, the pixels, and what the family's forward
    also takes (`image_grid_thw`, `mm_token_type_ids`). `family`: the dir's, where the model that runs is a
    wrapper's text submodule (its config names another model type); else the model's own."""
    config = model.config
    if family is None:
        name = normalise_model_type(getattr(config, "model_type", None))
        family = family_named(name) if name else None
    wrapper = family.wrapper if family is not None else None
    if wrapper is None or not wrapper.image_input:
        return None
    vision = config.vision_config
    batch = ids.shape[0]
    pixels = {k: v.to(ids.device) for k, v in _pixels(family, vision, batch, torch.Generator().manual_seed(2)).items()}
    one = {k: v[: v.shape[0] // batch] for k, v in pixels.items()}
    # the base model's, else the model's own (4.x Qwen3-Omni's thinker: its `model` is the text decoder)
    owner = model.model if hasattr(model.model, "get_image_features") else model
    if "vision_feature_layer" in inspect.signature(owner.get_image_features).parameters:
        # its forward fills this from the config; called on its own, it must be given (Mistral 3 and kin)
        one["vision_feature_layer"] = getattr(config, "vision_feature_layer", -1)
    with torch.no_grad():
        first = owner.get_image_features(**one)
    # 5.x: an output whose pooler_output lists each image's features; 4.x: a tuple led by them
    first = getattr(first, "pooler_output", first)
    while isinstance(first, (list, tuple)):
        first = first[0]
    tokens = first.reshape(-1, first.shape[-1]).shape[0]
    image_token = getattr(config, wrapper.image_token_key)
    opening = [getattr(config, wrapper.image_start_key)] if wrapper.image_start_key else []
    closing = [getattr(config, wrapper.image_end_key)] if wrapper.image_end_key else []
    span = [*opening, *[image_token] * tokens, *closing]
    if len(span) + 2 > ids.shape[1]:
        raise ValueError(f"{family.model_type}: a {len(span)}-token image does not fit a {ids.shape[1]}-token prompt")
    specials = torch.tensor(sorted({image_token, *opening, *closing}), device=ids.device)
    # the text around the image holds none of the image's special tokens (ids below the lowest of them)
    with_image = torch.where(torch.isin(ids, specials), ids % specials.min(), ids)
    with_image[:, 1:1 + len(span)] = torch.tensor(span, device=ids.device)
    out = {"input_ids": with_image, **pixels}
    parameters = inspect.signature(model.forward).parameters
    if wrapper.token_types and "mm_token_type_ids" in parameters:  # 5.x only
        out["mm_token_type_ids"] = (with_image == image_token).to(torch.int)
    if wrapper.moe_token_types and "moe_mm_token_type_ids" in parameters:
        # the image's tokens and its delimiters go to the vision expert set (the text tokens to the text set)
        out["moe_mm_token_type_ids"] = torch.isin(with_image, specials).to(torch.int)
    return out
