"""One step of continuous batching on every rank: the same forward passes, from the step's composition that rank
0 sends (codegen.serve.batching plans it, codegen.serve.plans carries it).

The running sequences share one KV cache, left-padded to the longest: a step drops the rows that left (and the
columns no remaining row needs), decodes one token for every remaining row in one forward pass (each row at its
own position, the padding masked out), then prefills the joining prompts (together, left-padded to the longest)
and appends their cache rows.
A sliding-window layer (transformers' DynamicSlidingWindowLayer: gpt-oss, every other layer) batches the same way:
it keeps the last window - 1 of the batch's columns, and its `cumulative_length` is the batch's width, so the masks
transformers builds from it line up with the rows' left padding.
Models whose cache is anything else (recurrent state, chunked or offloaded layers) keep one cache per sequence and
decode them one by one in the same step. Returns each stepped row's last logits (rank 0 samples).
"""

from __future__ import annotations

import inspect


class Engine:
    def __init__(self, model) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.device = next(model.parameters()).device
        self.reset()

    def reset(self) -> None:
        """Forget every row (after a failed step, on every rank alike)."""
        self.rows: list[int] = []
        self.lengths: list[int] = []
        self.cache = None
        self.mask = None
        self.separate: dict[int, tuple] = {}  # id -> (cache, length): models whose cache cannot be batched
        self.batched: bool | None = None

    def step(self, plan: dict) -> dict:
        import torch

        with torch.no_grad():
            self._drop(set(plan["drop"]))
            logits = {}
            decode = plan["decode"]
            if decode:
                if [sid for sid, _ in decode] != self.rows:
                    raise RuntimeError("the step's rows differ from this rank's batch")
                logits.update(self._decode([token for _, token in decode]))
            new = list(plan["new"])
            if new and self.batched is None:  # the first prompt tells whether the cache can be batched
                sid, prompt = new.pop(0)
                logits[sid] = self._prefill(sid, prompt)
            if len(new) > 1 and self.batched:
                logits.update(self._prefill_many(new))
            else:
                for sid, prompt in new:
                    logits[sid] = self._prefill(sid, prompt)
        return logits

    # ------------------------------------------------------------------------------------------------ internals

    def _forward(self, ids, cache, **kwargs):
        out = self.model(input_ids=ids.to(self.device), use_cache=True, **{self._cache_kw: cache}, **self._keep,
                         **kwargs)
        new_cache = getattr(out, "cache", None) if self._cache_kw == "cache" else None
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[:, -1, :], new_cache

    def _drop(self, gone: set[int]) -> None:
        if not gone:
            return
        keep = [i for i, sid in enumerate(self.rows) if sid not in gone]
        for sid in gone:
            self.separate.pop(sid, None)
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if not self.batched or self.cache is None:
            return
        if not keep:
            self.cache = self.mask = None
            return
        import torch

        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        first = int(torch.nonzero(self.mask.any(0))[0])  # the columns before it are padding in every row left
        self.mask = self.mask[:, first:]
        width = self.mask.shape[1]
        for layer in self.cache.layers:
            keys = layer.keys.index_select(0, index.to(layer.keys.device))
            values = layer.values.index_select(0, index.to(layer.values.device))
            start = keys.shape[2] - _kept(layer, width)
            layer.keys, layer.values = keys[:, :, start:], values[:, :, start:]
            _set_width(layer, width)

    def _decode(self, tokens: list[int]) -> dict:
        import torch

        if not self.batched:
            out = {}
            for row, (sid, token) in enumerate(zip(self.rows, tokens)):
                cache, length = self.separate[sid]
                logits, cache = self._forward(torch.tensor([[token]]), cache)
                self.separate[sid] = (cache, length + 1)
                self.lengths[row] = length + 1
                out[sid] = logits[0]
            return out
        ids = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
        self.mask = torch.cat([self.mask, torch.ones((len(tokens), 1), dtype=self.mask.dtype,
                                                     device=self.mask.device)], dim=1)
        positions = torch.tensor(self.lengths, dtype=torch.long, device=self.device).unsqueeze(1)
        logits, self.cache = self._forward(ids, self.cache, attention_mask=self.mask, position_ids=positions)
        self.lengths = [n + 1 for n in self.lengths]
        return {sid: logits[row] for row, sid in enumerate(self.rows)}

    def _prefill(self, sid: int, prompt: list[int]):
        import torch

        ids = torch.tensor([prompt], dtype=torch.long)
        logits, cache = self._forward(ids, None, attention_mask=torch.ones_like(ids).to(self.device))
        if self.batched is None:
            layers = getattr(cache, "layers", None)
            self.batched = bool(layers) and all(_batchable(layer) for layer in layers)
        self.rows.append(sid)
        self.lengths.append(len(prompt))
        if not self.batched:
            self.separate[sid] = (cache, len(prompt))
            return logits[0]
        self._append(cache, torch.ones((1, len(prompt)), dtype=torch.long, device=self.device))
        return logits[0]

    def _prefill_many(self, new: list) -> dict:
        """Several joining prompts in one forward pass, left-padded to the longest (batched caches only)."""
        import torch

        width = max(len(prompt) for _, prompt in new)
        ids = torch.zeros((len(new), width), dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for row, (_, prompt) in enumerate(new):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        mask, positions = mask.to(self.device), positions.to(self.device)
        logits, cache = self._forward(ids, None, attention_mask=mask, position_ids=positions)
        self._append(cache, mask)
        for sid, prompt in new:
            self.rows.append(sid)
            self.lengths.append(len(prompt))
        return {sid: logits[row] for row, (sid, _) in enumerate(new)}

    def _append(self, cache, mask) -> None:
        """Rows of a fresh cache (and their mask) appended to the batch's, both left-padded to the wider."""
        import torch

        if self.cache is None:
            self.cache, self.mask = cache, mask
            return
        width, new = self.mask.shape[1], mask.shape[1]
        full = max(width, new)
        self.mask = torch.cat([_left_pad(self.mask, full - width, 1), _left_pad(mask, full - new, 1)], dim=0)
        for old_layer, new_layer in zip(self.cache.layers, cache.layers):
            kept = _kept(old_layer, full)
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, kept - old_layer.keys.shape[2], 2),
                                        _left_pad(new_layer.keys, kept - new_layer.keys.shape[2], 2)], dim=0)
            old_layer.values = torch.cat([_left_pad(old_layer.values, kept - old_layer.values.shape[2], 2),
                                          _left_pad(new_layer.values, kept - new_layer.values.shape[2], 2)], dim=0)
            _set_width(old_layer, full)


#: transformers' cache layers whose rows can share one left-padded batch: plain key/value tensors, and the sliding
#: window's (its last window - 1 columns, as it keeps them while it decodes)
_FULL, _SLIDING = "DynamicLayer", "DynamicSlidingWindowLayer"


def _batchable(layer) -> bool:
    kind = type(layer).__name__
    if getattr(layer, "keys", None) is None or kind not in (_FULL, _SLIDING):
        return False
    return kind == _FULL or (isinstance(getattr(layer, "sliding_window", None), int)
                             and isinstance(getattr(layer, "cumulative_length", None), int)
                             and not getattr(layer, "record_past", False))


def _kept(layer, width: int) -> int:
    """How many of a batch's `width` columns `layer` holds: all, or a sliding window's last window - 1."""
    if type(layer).__name__ == _SLIDING:
        return min(width, layer.sliding_window - 1)
    return width


def _set_width(layer, width: int) -> None:
    """A sliding-window layer counts the batch's columns (its masks' offset comes from it)."""
    if type(layer).__name__ == _SLIDING:
        layer.cumulative_length = width


def _left_pad(tensor, n: int, dim: int):
    if n == 0:
        return tensor
    import torch

    shape = list(tensor.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=tensor.dtype, device=tensor.device), tensor], dim=dim)
