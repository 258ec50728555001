"""Tensor-parallel groups and the one reduction per MoE layer, always over the group DeepSpeed shards with.

Ranks form groups of `tp_size` consecutive ranks (`TensorParallelGroups`, DeepSpeed's `mpu`); the reducer
attached to each MoE block sums its partial outputs over that group, never over WORLD.
"""

import torch

from codegen.policy.runtime.base import PolicyError


def _sum_in_group(dist, tensor, group, op=None):
    """torch.distributed's all-reduce through DeepSpeed's comm, over `group` (never WORLD by default)."""
    extra = {} if op is None else {"op": op}
    return dist.all_reduce(tensor, group=group, **extra)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group forward; identity backward (each rank's partial sum gets the full gradient)."""

    @staticmethod
    def forward(ctx, tensor, dist, group):
        out = tensor.contiguous().clone()
        _sum_in_group(dist, out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class CoalescedAllReduce:
    """Attached to each MoE block; the patched forward calls it once with routed + shared partial sums.

    Always over the TP group DeepSpeed shards with (never WORLD). Without autograd: DeepSpeed's
    `inference_all_reduce`, the path its own row-parallel layers take. With grad enabled on a tensor
    that needs it: an autograd-aware all-reduce whose backward passes the gradient through.
    """

    enabled = True

    def __init__(self, dist, group, world_size):
        self.dist = dist
        self.group = group
        self.world_size = world_size

    def __call__(self, tensor):
        if torch.is_grad_enabled() and tensor.requires_grad:
            return _AllReduceSum.apply(tensor, self.dist, self.group)
        tensor = tensor.contiguous()
        # DeepSpeed's fast path, the same one its row-parallel layers use
        self.dist.inference_all_reduce(tensor, group=self.group)
        return tensor


class GroupInferenceAllReduce:
    """Stands in for the backend's `inference_all_reduce` when its shared-memory kernel would ignore the group."""

    def __init__(self, dist):
        self.dist = dist

    def __call__(self, tensor, op=None, group=None):
        return _sum_in_group(self.dist, tensor, group, op)


class TensorParallelGroups:
    """DeepSpeed `mpu`: consecutive ranks form a TP group, so 4 ranks at tp_size 2 give [0, 1] and [2, 3]."""

    def __init__(self, dist, tp_size, group=None):
        self.dist = dist
        if group is not None:
            self.group = group
            return
        world = dist.get_world_size()
        if world % tp_size:
            raise PolicyError(f"world size {world} is not a multiple of tp_size {tp_size}")
        rank = dist.get_rank()
        self.group = None
        for start in range(0, world, tp_size):
            ranks = list(range(start, start + tp_size))
            group = dist.new_group(ranks)  # every rank creates every group, as torch requires
            if rank in ranks:
                self.group = group

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_world_size(self):
        return self.dist.get_world_size(group=self.group)

    def get_model_parallel_rank(self):
        return self.dist.get_rank(group=self.group)


def route_inference_reductions(backend, dist, several_groups, shm_live):
    """Send the backend's inference reductions through torch.distributed where DeepSpeed's CPU shared-memory
    kernel would be wrong or crash; returns a note saying so, or None.

    - several TP groups per node (4 ranks, tp_size 2): the kernel spans every local rank and ignores `group`, so it
      would sum over WORLD;
    - the kernel is built but was never set up in this process (DeepSpeed initialised without LOCAL_SIZE, before
      the policy could set it, or ranks on several nodes): its first reduction would segfault.
    """
    if backend is None or backend.shm_comm_op is None or (shm_live and not several_groups):
        return None
    backend.inference_all_reduce = GroupInferenceAllReduce(dist)
    if several_groups:
        return None
    return ("DeepSpeed's shared-memory all-reduce was not set up (LOCAL_SIZE unset when DeepSpeed initialised, or "
            "ranks on several nodes): reducing through torch.distributed instead")
