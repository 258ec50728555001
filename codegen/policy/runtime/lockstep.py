"""Generation in lockstep: every rank of a tensor-parallel group produces the same tokens, or all stop with one line.

The ranks compute identical logits (every partial sum is all-reduced), so they diverge only through what each
feeds `generate`: its own random generator (a script that seeds `torch.manual_seed(seed + rank)`) or its own
inputs. Diverged ranks either produce different sequences silently or, when one stops early (an EOS), leave the
others waiting in a collective forever. So each `generate` call
- first gives every rank the group's first rank's random state and checks that every rank got the same inputs
  (a fingerprint per tensor);
- then, at every decoding step, checks that every rank chose the same tokens; a rank that would diverge raises a
  PolicyError on every rank at the same step, never a hang.
All of it rides on the group's inference all-reduce (DeepSpeed's shared-memory kernel on CPU, ~0.1 ms), exact
through `byte_digits`: a gloo all-gather cost a generating rank 1-2 ms a step, waiting included.
"""

import hashlib

import torch

from codegen.policy.runtime.base import PolicyError


def fingerprint(value):
    """Exact per-tensor digest of the tensors in `value` (nested lists, tuples, dicts): element count, sum and
    position-weighted sum, in float64; identical inputs give identical digests on every rank."""
    found = []

    def walk(item):
        if isinstance(item, torch.Tensor):
            flat = item.detach().reshape(-1).to("cpu", torch.float64)
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
            found.extend([float(flat.numel()), float(flat.sum()), float((flat * weights).sum())])
        elif isinstance(item, dict):
            for key in sorted(item, key=str):
                walk(item[key])
        elif isinstance(item, (list, tuple)):
            for part in item:
                walk(part)

    walk(value)
    return torch.tensor(found or [0.0], dtype=torch.float64)


def input_digest(value):
    """SHA-256 of `value`'s fingerprint, as 32 bytes: a digest of one length whatever the inputs hold."""
    return torch.tensor(list(hashlib.sha256(fingerprint(value).numpy().tobytes()).digest()), dtype=torch.uint8)


#: the most ranks whose byte digits sum exactly in float32: each sum of squares stays under 2**24 (255**2 * 258)
MOST_RANKS_SUMMED = 258
INPUTS_DIFFER = "were given different inputs to generate"
TOKENS_DIFFER = "chose different tokens while generating"


def byte_digits(values):
    """One rank's share of an exact same-values check, summed over the group: the bytes d of `values`, then their
    squares d*d, as float32.

    Over n ranks, n * sum(d*d) - sum(d)**2 is the sum of (d_i - d_j)**2 over every pair of ranks, so it is zero for
    every byte exactly when every rank holds the same values, bit for bit; with bytes, both sums are integers below
    2**24, so a float32 all-reduce adds them exactly in any order.
    """
    own = torch.empty(values.numel(), dtype=values.dtype)  # strides of its own: a size-1 column slice keeps its row's
    own.copy_(values.reshape(-1))
    digits = own.view(torch.uint8).to(torch.float32)
    return torch.cat([digits, digits * digits])


def digits_agree(summed, world):
    """Whether the group's summed `byte_digits` say every rank held the same values (exact, in int64)."""
    total, squares = summed.to("cpu", torch.int64).chunk(2)
    return torch.equal(world * squares, total * total)


class Lockstep:
    """The group's collectives for one model: random state shared, inputs and step tokens compared."""

    def __init__(self, dist, group, device):
        self.dist = dist
        self.group = group
        self.device = device
        self.world = dist.get_world_size(group=group)
        self.first = torch.distributed.get_process_group_ranks(group)[0] if group is not None else 0

    def _gathered(self, tensor):
        tensor = tensor.to(self.device)
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        self.dist.all_gather(out, tensor, group=self.group)
        return [t.cpu() for t in out]

    def _summed(self, tensor):
        tensor = tensor.to(self.device)
        self.dist.inference_all_reduce(tensor, group=self.group)
        return tensor.cpu()

    def begin(self, inputs):
        """Before a generate call: every rank takes the first rank's random state, and the ranks check that they
        were given the same `inputs`. One reduction: the state with the digits of the inputs' digest, which has
        the same length on every rank (the start took two, 0.4 ms of toy gpt-oss's batch-1 time to first token)."""
        digest = input_digest(inputs)
        if self.world > MOST_RANKS_SUMMED:
            self._broadcast_random_state()
            return self.check_same(digest, INPUTS_DIFFER)
        state = torch.get_rng_state()
        first = self.dist.get_rank(group=self.group) == 0
        shared = state.to(torch.float32) if first else torch.zeros(state.numel())  # a sum of one rank's bytes
        summed = self._summed(torch.cat([shared, byte_digits(digest)]))
        torch.set_rng_state(summed[:state.numel()].to(torch.uint8))
        self._broadcast_cuda_random_state()
        if not digits_agree(summed[state.numel():], self.world):
            self._refuse(INPUTS_DIFFER)

    def _broadcast_random_state(self):
        state = torch.get_rng_state().to(self.device)
        self.dist.broadcast(state, src=self.first, group=self.group)
        torch.set_rng_state(state.cpu())
        self._broadcast_cuda_random_state()

    def _broadcast_cuda_random_state(self):
        if self.device.type == "cuda":
            cuda_state = torch.cuda.get_rng_state().to(self.device)
            self.dist.broadcast(cuda_state, src=self.first, group=self.group)
            torch.cuda.set_rng_state(cuda_state.cpu())

    def check_same(self, tensor, what):
        """Through an all-gather: tensors of any shape (the fallback where the group is too wide to sum digits)."""
        rows = self._gathered(tensor)
        if tensor.numel() and any(r.shape != rows[0].shape or not torch.equal(r, rows[0]) for r in rows):
            self._refuse(what)

    def check_same_tokens(self, tokens):
        """Every rank chose the same step tokens (a batch's worth, the same count on every rank: the step's)."""
        if self.world > MOST_RANKS_SUMMED:
            return self.check_same(tokens, TOKENS_DIFFER)
        self._check_digits(tokens, TOKENS_DIFFER)

    def _check_digits(self, values, what):
        if not digits_agree(self._summed(byte_digits(values)), self.world):
            self._refuse(what)

    @staticmethod
    def _refuse(what):
        raise PolicyError(f"the ranks of a tensor-parallel group {what}: every rank must call generate with "
                          "the same inputs (the policy shares the random state, so per-rank seeds are fine)")


def keep_in_lockstep(model, dist, group, device):
    """Wrap `model.generate` (on the instance) so the group's ranks generate in lockstep; returns the wrapper."""
    if not callable(getattr(model, "generate", None)) or getattr(model.generate, "_codegen_lockstep", False):
        return getattr(model, "generate", None)
    from transformers import StoppingCriteria, StoppingCriteriaList

    original = model.generate
    lockstep = Lockstep(dist, group, device)

    class SameTokens(StoppingCriteria):
        """Never stops a sequence; raises where the ranks chose different tokens at this step."""

        def __call__(self, input_ids, scores, **kwargs):
            lockstep.check_same_tokens(input_ids[:, -1])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(*args, **kwargs):
        lockstep.begin([args, {k: v for k, v in kwargs.items() if k != "streamer"}])
        criteria = StoppingCriteriaList(list(kwargs.pop("stopping_criteria", None) or []) + [SameTokens()])
        return original(*args, stopping_criteria=criteria, **kwargs)

    generate._codegen_lockstep = True
    generate.__doc__ = original.__doc__
    model.generate = generate
    return generate
