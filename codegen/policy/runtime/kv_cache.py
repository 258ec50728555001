"""A compiled CPU rank's KV cache appends its new columns in place instead of copying itself at every step.

transformers' caches append by `torch.cat`: every decode step reads and writes the whole cache of every layer once
more, into newly allocated memory, before attention reads it (measured, a compiled toy Qwen1.5-MoE decode step at
batch 16 with 128-token prompts on 2 ranks: 11.5 ms with it, 8.4 ms appending in place). A sliding-window layer
(`DynamicSlidingWindowLayer`: gpt-oss's every other layer) concatenates, then cuts back to its window, so it copies
its whole window every step (the toy gpt-oss step, the same way: 12.5-12.8 ms with it, 11.5 ms in place).
Before a compiled forward runs (codegen.policy.runtime.compiled), each such layer of the cache it was given adopts a
store with room for `KV_HEADROOM` more columns: its keys and values are views of the store's columns
`start:end`, a step writes its columns into the store (one copy of the new columns) and attention gets a view of
the columns in use; a sliding layer's `start` moves up as its window does. The store is allocated again, with room
to spare, when a forward would outgrow it (once per `KV_HEADROOM` decode steps) or when the caller replaced a
layer's keys (codegen's server drops and appends batch rows that way). `start` and `end` are Python ints, which the
compiled graph takes as symbolic sizes: one graph serves every length.
"""

import functools

import torch

#: columns a store keeps free past what a forward needs when it is allocated (a decode step takes one per row)
KV_HEADROOM = 256


def _store_layer(base):
    """A subclass of transformers' cache layer `base` whose keys and values are views of a store's columns."""

    class StoreLayer(base):
        """`base` whose keys and values are views of the columns `start:end` of a larger store: `update` writes
        the new columns into the store. With no store (`adopt_store` not run since the keys last changed under
        it), it is a `base`."""

        key_store = value_store = None
        #: the columns in use, `start:end`: kept apart from `keys` so that the graph never reads `keys`, a view of
        #: the store it writes (two aliased inputs, one mutated, which torch.compile handles by rebuilding both)
        start = end = 0

        def update(self, key_states, value_states, *args, **kwargs):
            start, end = self.start, self.end
            stop = end + key_states.shape[-2]
            # no store, no room made (`adopt_store`), or a sliding layer keeping its past for a crop: as `base` does
            if self.key_store is None or stop >= self.key_store.shape[2] or getattr(self, "record_past", False):
                self.key_store = self.value_store = None
                return super().update(key_states, value_states, *args, **kwargs)
            self.key_store[:, :, end:stop].copy_(key_states)
            self.value_store[:, :, end:stop].copy_(value_states)
            keys, values = self.key_store[:, :, start:stop], self.value_store[:, :, start:stop]
            window = getattr(self, "sliding_window", None)
            if window is not None:  # attention sees the window and the new columns; the layer keeps window - 1
                self.cumulative_length += stop - end
                if stop - start >= window:  # full: the window moves up (a graph for each side of this test)
                    start = stop - window + 1
            self.start, self.end = start, stop
            self.keys, self.values = self.key_store[:, :, start:stop], self.value_store[:, :, start:stop]
            return keys, values

        def get_seq_length(self):
            if self.key_store is None or getattr(self, "sliding_window", None) is not None:
                return super().get_seq_length()  # a sliding layer counts every column it was given
            return self.end

    # the ways transformers changes a layer's keys besides `update` (beam search, assisted decoding, batch expansion,
    # reuse): the store goes with them
    for name in ("reset", "crop", "reorder_cache", "batch_repeat_interleave", "batch_select_indices"):
        if hasattr(base, name):
            setattr(StoreLayer, name, _dropping_store(getattr(base, name)))
    StoreLayer.__name__ = StoreLayer.__qualname__ = "Appending" + base.__name__.removeprefix("Dynamic")
    return StoreLayer


def _dropping_store(change):
    """transformers' layer method `change`, run after the layer lets go of its store."""

    @functools.wraps(change)
    def method(self, *args, **kwargs):
        self.key_store = self.value_store = None
        return change(self, *args, **kwargs)

    return method


@functools.lru_cache(maxsize=1)
def store_layer_classes() -> dict:
    """transformers' growing cache layers (`DynamicLayer`, `DynamicSlidingWindowLayer`), each mapped to its
    appending subclass (`AppendingLayer`, `AppendingSlidingWindowLayer`); empty where transformers has none (4.x
    before 4.56 keeps its cache as lists, left as they are)."""
    import transformers.cache_utils as cache_utils

    bases = [getattr(cache_utils, name, None) for name in ("DynamicLayer", "DynamicSlidingWindowLayer")]
    return {base: _store_layer(base) for base in bases if base is not None}


def _holds_store_window(layer):
    """Whether the layer's keys and values are still its stores' columns `start:end` (not replaced under it).
    Addresses and sizes only, no views taken: it runs for every layer before every step."""
    start, end = layer.start, layer.end
    for tensor, store in ((layer.keys, layer.key_store), (layer.values, layer.value_store)):
        if not (isinstance(tensor, torch.Tensor) and isinstance(store, torch.Tensor)):
            return False
        at = store.data_ptr() + start * store.stride(2) * store.element_size()
        if (tensor.data_ptr() != at or tensor.shape != (*store.shape[:2], end - start, store.shape[3])
                or tensor.stride() != store.stride()):
            return False
    return True


def _store_of(tensor, columns):
    store = tensor.new_empty(tensor.shape[0], tensor.shape[1], columns, tensor.shape[3])
    store[:, :, :tensor.shape[2]].copy_(tensor)
    return store


def adopt_store(layer, new_columns):
    """Give the layer a store with room for `new_columns` more columns, unless it has one already.

    A store always keeps a column free: a view of all its columns would be contiguous where the others are not, and
    the compiled graph, which guards on that, would be captured once more."""
    if _holds_store_window(layer) and layer.end + new_columns < layer.key_store.shape[2]:
        return
    length = layer.keys.shape[2]
    columns = length + new_columns + KV_HEADROOM
    layer.key_store, layer.value_store = _store_of(layer.keys, columns), _store_of(layer.values, columns)
    layer.start, layer.end = 0, length
    layer.keys, layer.values = layer.key_store[:, :, :length], layer.value_store[:, :, :length]


def append_in_place(cache, new_columns):
    """Before a forward that adds `new_columns` columns to `cache`: every growing layer of it (transformers'
    `DynamicLayer` or `DynamicSlidingWindowLayer` itself, on CPU, holding 4-D keys) appends in place from then on.
    Any other cache or layer is left as it is."""
    classes = store_layer_classes()
    if not classes or not isinstance(new_columns, int) or new_columns < 1:
        return
    for layer in getattr(cache, "layers", None) or ():
        kind = type(layer)
        store_class = classes.get(kind) or (kind if kind in classes.values() else None)
        if store_class is None:  # not transformers' own growing layer, nor one adopted before
            continue
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (getattr(layer, "is_initialized", False) and isinstance(keys, torch.Tensor)
                and isinstance(values, torch.Tensor) and keys.dim() == values.dim() == 4 and keys.numel() > 0
                and keys.device.type == values.device.type == "cpu" and keys.shape[2] == values.shape[2]):
            continue
        layer.__class__ = store_class
        adopt_store(layer, new_columns)
