"""A compiled CPU rank's KV cache appends its new columns in place instead of copying itself at every step.

transformers' growing cache (`DynamicLayer`) appends by `torch.cat`: every decode step reads and writes the whole
cache of every layer once more, into newly allocated memory, before attention reads it (measured, a compiled toy
Qwen1.5-MoE decode step at batch 16 with 128-token prompts on 2 ranks: 11.5 ms with it, 8.4 ms appending in place).
Before a compiled forward runs (codegen.policy.runtime.compiled), each such layer of the cache it was given becomes
an `AppendingLayer`: its keys and values live at the front of a store with room for `KV_HEADROOM` more columns, a
step writes its columns into the store (one copy of the new columns) and attention gets a view of the columns in
use. The store is allocated again, with room to spare, when a forward would outgrow it (once per `KV_HEADROOM`
decode steps) or when the caller replaced a layer's keys (codegen's server drops and appends batch rows that way).
The layer's length is a Python int, which the compiled graph takes as a symbolic size: one graph serves every
length.
"""

import functools

import torch

#: columns a store keeps free past what a forward needs when it is allocated (a decode step takes one per row)
KV_HEADROOM = 256


@functools.lru_cache(maxsize=1)
def appending_layer_class():
    """`AppendingLayer`, a subclass of transformers' `DynamicLayer`; None where transformers has none (4.x keeps
    its cache as lists, left as they are)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class AppendingLayer(DynamicLayer):
        """`DynamicLayer` whose keys and values are views of the first `length` columns of a larger store: `update`
        writes the new columns into the store. With no store (`adopt_store` not run since the keys last changed
        under it), it is a `DynamicLayer`."""

        key_store = value_store = None
        #: the columns in use: `keys.shape[2]`, kept apart so that the graph never reads `keys`, a view of the store
        #: it writes (two aliased inputs, one mutated, which torch.compile handles by rebuilding both)
        length = 0

        def update(self, key_states, value_states, *args, **kwargs):
            start = self.length
            end = start + key_states.shape[-2]
            if self.key_store is None or end >= self.key_store.shape[2]:  # no store, or no room made (`adopt_store`)
                self.key_store = self.value_store = None
                return super().update(key_states, value_states, *args, **kwargs)
            self.key_store[:, :, start:end].copy_(key_states)
            self.value_store[:, :, start:end].copy_(value_states)
            self.length = end
            self.keys, self.values = self.key_store[:, :, :end], self.value_store[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self):
            return self.length if self.key_store is not None else super().get_seq_length()

        # the ways transformers changes a layer's keys besides `update` (beam search, assisted decoding, batch
        # expansion, reuse): the store goes with them
        def reset(self):
            self.key_store = self.value_store = None
            super().reset()

        def crop(self, tokens_to_remove):
            self.key_store = self.value_store = None
            super().crop(tokens_to_remove)

        def reorder_cache(self, beam_idx):
            self.key_store = self.value_store = None
            super().reorder_cache(beam_idx)

        def batch_repeat_interleave(self, repeats):
            self.key_store = self.value_store = None
            super().batch_repeat_interleave(repeats)

        def batch_select_indices(self, indices):
            self.key_store = self.value_store = None
            super().batch_select_indices(indices)

    return AppendingLayer


def _holds_store_front(layer):
    """Whether the layer's keys and values are still its stores' first `length` columns (not replaced under it)."""
    keys, values, key_store, value_store = layer.keys, layer.values, layer.key_store, layer.value_store
    return (key_store is not None and value_store is not None and isinstance(keys, torch.Tensor)
            and isinstance(values, torch.Tensor) and keys.data_ptr() == key_store.data_ptr()
            and values.data_ptr() == value_store.data_ptr() and keys.shape[2] == values.shape[2] == layer.length
            and keys.shape[:2] == key_store.shape[:2] and values.shape[:2] == value_store.shape[:2]
            and keys.stride() == key_store.stride() and values.stride() == value_store.stride())


def _store_of(tensor, columns):
    store = tensor.new_empty(tensor.shape[0], tensor.shape[1], columns, tensor.shape[3])
    store[:, :, :tensor.shape[2]].copy_(tensor)
    return store


def adopt_store(layer, new_columns):
    """Give the layer a store with room for `new_columns` more columns, unless it has one already.

    A store always keeps a column free: a view of all its columns would be contiguous where the others are not, and
    the compiled graph, which guards on that, would be captured once more."""
    if _holds_store_front(layer) and layer.length + new_columns < layer.key_store.shape[2]:
        return
    length = layer.keys.shape[2]
    columns = length + new_columns + KV_HEADROOM
    layer.key_store, layer.value_store = _store_of(layer.keys, columns), _store_of(layer.values, columns)
    layer.length = length
    layer.keys, layer.values = layer.key_store[:, :, :length], layer.value_store[:, :, :length]


def append_in_place(cache, new_columns):
    """Before a forward that adds `new_columns` columns to `cache`: every growing layer of it (transformers'
    `DynamicLayer` itself, on CPU, holding 4-D keys) appends in place from then on. Any other cache or layer is
    left as it is."""
    layer_class = appending_layer_class()
    if layer_class is None or not isinstance(new_columns, int) or new_columns < 1:
        return
    for layer in getattr(cache, "layers", None) or ():
        if type(layer) not in (layer_class, layer_class.__base__):  # transformers' DynamicLayer, or one adopted before
            continue
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (getattr(layer, "is_initialized", False) and isinstance(keys, torch.Tensor)
                and isinstance(values, torch.Tensor) and keys.dim() == values.dim() == 4 and keys.numel() > 0
                and keys.device.type == values.device.type == "cpu" and keys.shape[2] == values.shape[2]):
            continue
        layer.__class__ = layer_class
        adopt_store(layer, new_columns)
