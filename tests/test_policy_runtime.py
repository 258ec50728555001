"""The policy runtime (codegen/policy/runtime/, as assembled into every autotp_policy.py) driven directly: small
nn.Module trees, a fake process group, a fake DeepSpeed.

No ranks are launched here (tests/test_runtime.py and tests/test_verify.py run the rendered policy on real
DeepSpeed ranks). The layouts are the family table's own (`Family.policy_layout()`) plus a made-up family
whose every name differs, which proves the runtime holds no family knowledge of its own.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import os
import re
import sys
import types
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

from codegen.families import FAMILIES, KNOB
from codegen.patch.plan import family_policy
from codegen.policy.assemble import (PART_HEADER, SEPARATOR, AssemblyError, part_text, render_header, runtime_module,
                                     runtime_text, split_policy)
from codegen.policy.runtime import PARTS

pytestmark = pytest.mark.unit  # in-process, no subprocess, no ranks: the fast tier

#: the runtime exactly as a model dir's autotp_policy.py runs it (its parts assembled), without a header
rt = runtime_module()

ROOT = Path(__file__).resolve().parent.parent

#: a made-up family: no name here is one the real families use
TOY = {
    "family": "toy", "moe_classes": ["ToyMoe"], "experts": "bank",
    "per_expert": {"gate": "w1", "up": "w3", "down": "w2"},
    "fused": {"kind": "gate_up_rows", "gate_up": "w13", "down": "w2", "size_attr": "inter"},
    "shared": ["common"], "routers": ["router", "common_router"], "attention_replicated": ["kv_in"],
    "tp_divisible": ["heads", "ffn"],
}
H, I, E = 8, 4, 3  # hidden, expert intermediate, experts


def _one_line(info) -> str:
    message = str(info.value)
    assert message and "\n" not in message
    return message


# ------------------------------------------------------------------------------------------- fake torch.dist


class FakeGroup:
    def __init__(self, ranks):
        self.ranks = list(ranks)


class FakeDist:
    """deepspeed.comm as the policy uses it, for one rank; reductions are recorded, not performed."""

    def __init__(self, world=2, rank=0):
        self.world, self.rank = world, rank
        self.calls, self.groups = [], []

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return len(group.ranks) if group is not None else self.world

    def get_rank(self, group=None):
        return group.ranks.index(self.rank) if group is not None else self.rank

    def new_group(self, ranks):
        self.groups.append(list(ranks))
        return FakeGroup(ranks)

    def all_reduce(self, tensor, group=None, **kwargs):
        self.calls.append(("all_reduce", group, kwargs))

    def inference_all_reduce(self, tensor, group=None):
        self.calls.append(("inference_all_reduce", group, {}))

    barriers = 0

    def barrier(self, group=None):
        self.barriers += 1

    #: what the other ranks contribute to an all_gather: rank -> tensor (default: the same as this rank's)
    peers: typing.ClassVar[dict] = {}

    def all_gather(self, tensors, tensor, group=None):
        self.calls.append(("all_gather", group, {}))
        for index, out in enumerate(tensors):
            out.copy_(tensor if index == self.get_rank(group) else self.peers.get(index, tensor))


# ----------------------------------------------------------------------------------- fake DeepSpeed AutoTP


class FakeColumn(nn.Module):
    """What DeepSpeed makes of a column-parallel nn.Linear: this rank's output rows."""

    def __init__(self, linear, rank, world):
        super().__init__()
        rows = linear.out_features // world
        self.weight = nn.Parameter(linear.weight.data[rank * rows:(rank + 1) * rows].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data[rank * rows:(rank + 1) * rows].clone())

    def forward(self, x):
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class FakeRow(nn.Module):
    """What DeepSpeed makes of a row-parallel nn.Linear: this rank's input columns, then its own reduction."""

    def __init__(self, linear, rank, world, dist=None):
        super().__init__()
        cols = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.data[:, rank * cols:(rank + 1) * cols].clone())
        self.bias = linear.bias
        self.tp_index = rank
        self.dist = dist

    def forward(self, x):
        self.dist.calls.append(("row layer reduces", None, {}))
        return x @ self.weight.T + (0 if self.bias is None else self.bias)


def fake_deepspeed(dist, rows=("w2", "o")):
    """Module objects standing in for deepspeed: init_inference wraps EVERY nn.Linear, subclasses included."""

    def init_inference(model, tensor_parallel, dtype, replace_with_kernel_inject):
        group = tensor_parallel["mpu"].get_model_parallel_group()
        rank, world = dist.get_rank(group), dist.get_world_size(group)

        def walk(module):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    cls = FakeRow if name in rows else FakeColumn
                    setattr(module, name, cls(child, rank, world, dist) if cls is FakeRow else cls(child, rank, world))
                else:
                    walk(child)

        walk(model)
        model.to(dtype)
        return types.SimpleNamespace(module=model, mp_group=group)

    class TPConfig:
        model_fields: typing.ClassVar[dict] = {"tp_size": None, "mpu": None, "tp_group": None}

    backend = types.SimpleNamespace(inference_all_reduce=lambda *a, **k: None, shm_comm_op=None)
    ds = types.ModuleType("fake_deepspeed")
    ds.__file__ = str(ROOT / "nowhere" / "__init__.py")
    ds.__version__ = "0.0-fake"
    ds.init_inference, ds.init_distributed = init_inference, lambda: None
    ds.comm = types.SimpleNamespace(all_reduce=dist.all_reduce, inference_all_reduce=dist.inference_all_reduce,
                                    all_gather=dist.all_gather, comm=types.SimpleNamespace(cdb=backend))
    ds.module_inject = types.SimpleNamespace(layers=types.SimpleNamespace(LinearLayer=FakeColumn, LinearAllreduce=FakeRow))
    ds.inference = types.SimpleNamespace(config=types.SimpleNamespace(DeepSpeedTPConfig=TPConfig))
    return ds


@pytest.fixture
def with_fake_deepspeed(monkeypatch):
    """Install a fake deepspeed (and deepspeed.comm) for one rank of `world`; returns (ds, dist)."""

    def install(world=2, rank=0):
        dist = FakeDist(world, rank)
        ds = fake_deepspeed(dist)
        ds.__name__ = "deepspeed"
        comm = types.ModuleType("deepspeed.comm")
        for name in ("is_initialized", "get_world_size", "get_rank", "new_group", "all_reduce",
                     "inference_all_reduce", "all_gather", "barrier"):
            setattr(comm, name, getattr(dist, name))
        comm.comm = ds.comm.comm
        ds.comm = comm
        monkeypatch.setitem(sys.modules, "deepspeed", ds)
        monkeypatch.setitem(sys.modules, "deepspeed.comm", comm)
        for sub in ("module_inject", "module_inject.layers", "inference", "inference.config"):
            monkeypatch.setitem(sys.modules, f"deepspeed.{sub}", types.ModuleType(f"deepspeed.{sub}"))
        monkeypatch.setattr(rt, "own_shm_buffer", lambda rank: None)  # no /dev/shm in these tests
        return ds, dist

    return install


# ------------------------------------------------------------------------------------------- a toy model


class Router(nn.Linear):
    """A router that subclasses nn.Linear: DeepSpeed would wrap it like any Linear."""


class MLP(nn.Module):
    def __init__(self, names):
        super().__init__()
        for role, (i, o) in {"gate": (H, I), "up": (H, I), "down": (I, H)}.items():
            setattr(self, names[role], nn.Linear(i, o, bias=False))
        self.names = names

    def forward(self, x):
        n = self.names
        return getattr(self, n["down"])(torch.relu(getattr(self, n["gate"])(x)) * getattr(self, n["up"])(x))


class FusedBank(nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names
        setattr(self, names["gate_up"], nn.Parameter(torch.randn(E, 2 * I, H)))
        setattr(self, names["down"], nn.Parameter(torch.randn(E, H, I)))
        setattr(self, names["size_attr"], I)

    def forward(self, x, weights):
        out = torch.zeros_like(x)
        for e in range(E):
            gate, up = nn.functional.linear(x, getattr(self, self.names["gate_up"])[e]).chunk(2, dim=-1)
            out = out + weights[:, e:e + 1] * nn.functional.linear(torch.relu(gate) * up,
                                                                   getattr(self, self.names["down"])[e])
        return out


class ToyMoe(nn.Module):
    def __init__(self, layout, fused):
        super().__init__()
        setattr(self, layout["routers"][0], Router(H, E, bias=False))
        setattr(self, layout["experts"], FusedBank(layout["fused"]) if fused
                else nn.ModuleList(MLP(layout["per_expert"]) for _ in range(E)))
        for shared in layout["shared"]:
            setattr(self, shared, MLP(layout["per_expert"]))
        setattr(self, layout["routers"][1], Router(H, 1, bias=False))
        self.layout = layout

    def forward(self, x):
        lay = self.layout
        weights = torch.softmax(getattr(self, lay["routers"][0])(x), dim=-1)
        experts = getattr(self, lay["experts"])
        if isinstance(experts, nn.ModuleList):
            routed = sum(weights[:, e:e + 1] * experts[e](x) for e in range(E))
        else:
            routed = experts(x, weights)
        shared = torch.sigmoid(getattr(self, lay["routers"][1])(x)) * getattr(self, lay["shared"][0])(x)
        out = routed + shared
        reducer = getattr(self, rt.REDUCER_ATTR, None)  # what the patched forward does, once
        return out if reducer is None else reducer(out)


class ToyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.kv_in = nn.Linear(H, H, bias=False)
        self.o = nn.Linear(H, H, bias=False)


class ToyModel(nn.Module):
    def __init__(self, fused=False, layout=TOY):
        super().__init__()
        self.config = types.SimpleNamespace(heads=4, ffn=8, codegen_knob=True)
        self.attn = ToyAttention()
        self.moe = ToyMoe(layout, fused)


_MODULE = types.ModuleType("toy_modeling_codegen")
_MODULE._CODEGEN_PATCH = {"family": "toy"}
ToyModel.__module__ = _MODULE.__name__
sys.modules[_MODULE.__name__] = _MODULE


def _toy(fused=False, seed=0):
    torch.manual_seed(seed)
    return ToyModel(fused).eval()


# ----------------------------------------------------------------------------------------- whole policy


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_policy_on_two_simulated_ranks_sums_to_the_unsharded_output(with_fake_deepspeed, fused):
    """Each rank's MoE output is a partial sum; the two add up to the unsharded block's output."""
    x = torch.randn(5, H)
    full = _toy(fused)
    with torch.no_grad():
        expected = full.moe(x)
    partial = []
    for rank in (0, 1):
        _, dist = with_fake_deepspeed(world=2, rank=rank)
        model = copy.deepcopy(full)
        routers = {r: getattr(model.moe, r) for r in TOY["routers"]}
        engine = rt.shard_model(model, 2, None, {}, TOY, "codegen_knob")
        assert dist.groups == [[0, 1]] and engine.mp_group.ranks == [0, 1]
        moe = engine.module.moe
        # routers and the replicated projection: the same objects, whole, in their place and order
        assert {r: getattr(moe, r) for r in TOY["routers"]} == routers
        assert list(moe._modules) == list(full.moe._modules)
        assert type(model.attn.kv_in) is nn.Linear and isinstance(model.attn.o, FakeRow)
        with torch.no_grad():
            partial.append(moe(x))
        # the one reduction, over the TP group, and no row layer reduced on its own
        assert [(c[0], c[1].ranks) for c in dist.calls] == [("inference_all_reduce", [0, 1])]
    torch.testing.assert_close(partial[0] + partial[1], expected)


#: several routed expert sets per MoE block (`Family.expert_sets`): a text and a vision set, each beside its own router
TWO_SETS = {**TOY, "moe_classes": ["ToyTwoSetsMoe"], "expert_sets": ["text.bank", "vision.bank"],
            "routers": ["text.router", "vision.router"], "attention_replicated": []}


class ToySet(nn.Module):
    """One expert set under its own router (ERNIE-VL's `text_moe` / `vision_moe`)."""

    def __init__(self):
        super().__init__()
        self.router = Router(H, E, bias=False)
        self.bank = FusedBank(TWO_SETS["fused"])

    def forward(self, x):
        return self.bank(x, torch.softmax(self.router(x), dim=-1))


class ToyTwoSetsMoe(nn.Module):
    """Text rows to one set, image rows to the other, a shared expert on all: reduced once, after the sum."""

    def __init__(self):
        super().__init__()
        self.text, self.vision = ToySet(), ToySet()
        self.common = MLP(TWO_SETS["per_expert"])

    def forward(self, x, image_rows):
        routed = torch.zeros_like(x)
        routed[~image_rows] = self.text(x[~image_rows])
        routed[image_rows] = self.vision(x[image_rows])
        out = routed + self.common(x)
        reducer = getattr(self, rt.REDUCER_ATTR, None)
        return out if reducer is None else reducer(out)


class ToyTwoSetsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(heads=4, ffn=8, codegen_knob=True)
        self.attn = ToyAttention()
        self.moe = ToyTwoSetsMoe()


ToyTwoSetsModel.__module__ = _MODULE.__name__


def test_several_expert_sets_are_all_sharded_under_one_reduction(with_fake_deepspeed):
    """Both sets split along their intermediate dim, both routers whole and in place; the two ranks' partial outputs
    (text rows, image rows and the shared expert) add up to the unsharded block's, with one reduction per rank."""
    torch.manual_seed(0)
    full = ToyTwoSetsModel().eval()
    x, image_rows = torch.randn(6, H), torch.tensor([False, True, True, False, True, False])
    with torch.no_grad():
        expected = full.moe(x, image_rows)
    partial = []
    for rank in (0, 1):
        _, dist = with_fake_deepspeed(world=2, rank=rank)
        model = copy.deepcopy(full)
        routers = [model.moe.text.router, model.moe.vision.router]
        engine = rt.shard_model(model, 2, None, {}, TWO_SETS, "codegen_knob")
        moe = engine.module.moe
        assert [moe.text.router, moe.vision.router] == routers
        assert all(r.weight.shape == (E, H) for r in routers)
        for expert_set in (moe.text.bank, moe.vision.bank):
            assert expert_set.w13.shape == (E, I, H) and expert_set.w2.shape == (E, H, I // 2)
            assert expert_set.inter == I // 2
        with torch.no_grad():
            partial.append(moe(x, image_rows))
        assert [c[0] for c in dist.calls] == ["inference_all_reduce"]
    torch.testing.assert_close(partial[0] + partial[1], expected)


def test_a_missing_expert_set_router_is_refused(with_fake_deepspeed):
    with_fake_deepspeed(world=2, rank=0)
    model = ToyTwoSetsModel()
    del model.moe.vision.router
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_model(model, 2, None, {}, TWO_SETS, "codegen_knob")
    assert _one_line(info) == "moe has no router 'vision.router' (named by the family table): re-run patch"


def test_per_set_sizes_each_divide_by_tp():
    layout = {**TWO_SETS, "tp_divisible": ["ffn"]}
    rt.check_sizes(types.SimpleNamespace(ffn=[8, 4]), 4, layout)
    with pytest.raises(rt.PolicyError) as info:
        rt.check_sizes(types.SimpleNamespace(ffn=[8, 6]), 4, layout)
    assert _one_line(info) == "tp_size 4 does not divide ffn = [8, 6]: pick a tp_size that divides it"


def test_fused_shards_concatenate_to_the_full_tensors():
    names = TOY["fused"]
    full = FusedBank(names)
    gate_up, down = full.w13.detach().clone(), full.w2.detach().clone()
    shards = []
    for rank in range(2):
        bank = copy.deepcopy(full)
        param = bank.w13
        rt.shard_fused_experts(bank, "moe.bank", rank, 2, names)
        assert bank.w13 is param and isinstance(bank.w13, nn.Parameter)  # same registered Parameter
        assert getattr(bank, rt.SHARDED_FLAG) is True and bank.inter == I // 2
        shards.append((bank.w13.detach(), bank.w2.detach()))
    gates = torch.cat([s[0][:, :I // 2] for s in shards], dim=1)
    ups = torch.cat([s[0][:, I // 2:] for s in shards], dim=1)
    assert torch.equal(torch.cat([gates, ups], dim=1), gate_up)  # gate|up packing kept per rank
    assert torch.equal(torch.cat([s[1] for s in shards], dim=2), down)


def test_halves_layout_shards_sum_to_the_full_transposed_experts():
    """Qwen3-VL-MoE on 4.x: gate_up [E, H, 2I] (gate columns, then up columns), down [E, I, H]. Each rank keeps
    its slice of the gate columns and the same slice of the up columns; the ranks' outputs sum to the whole."""
    names = {"kind": rt.FUSED_GATE_UP_HALVES_COLS, "gate_up": "gu", "down": "dn", "size_attr": "inter",
             "gate_up_bias": "", "down_bias": ""}
    full = nn.Module()
    full.gu, full.dn, full.inter = nn.Parameter(torch.randn(E, H, 2 * I)), nn.Parameter(torch.randn(E, I, H)), I

    def experts(bank, x):
        out = torch.zeros(x.shape[0], H)
        for e in range(E):
            gate, up = (x @ bank.gu[e]).chunk(2, dim=-1)
            out = out + (torch.relu(gate) * up) @ bank.dn[e]
        return out

    x = torch.randn(5, H)
    expected = experts(full, x)
    partial = []
    for rank in range(2):
        bank = copy.deepcopy(full)
        param = bank.gu
        rt.shard_fused_experts(bank, "moe.experts", rank, 2, names)
        assert bank.gu is param and tuple(bank.gu.shape) == (E, H, I) and tuple(bank.dn.shape) == (E, I // 2, H)
        assert bank.inter == I // 2
        partial.append(experts(bank, x))
    torch.testing.assert_close(partial[0] + partial[1], expected)
    odd = copy.deepcopy(full)
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_fused_experts(odd, "moe.experts", 0, 3, names)
    assert _one_line(info).startswith("moe.experts has gu (3, 8, 8) and dn (3, 4, 8): cannot split the expert size 4")


def test_fused_names_missing_is_one_line_naming_the_layer():
    bank = FusedBank({**TOY["fused"], "gate_up": "other"})
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_fused_experts(bank, "model.layers.3.moe.bank", 0, 2, TOY["fused"])
    assert _one_line(info) == ("model.layers.3.moe.bank has no 3-D Parameter 'w13' to shard: "
                               "its experts are not the fused layout the family table names")


def test_fused_size_that_does_not_split_is_refused():
    bank = FusedBank(TOY["fused"])
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_fused_experts(bank, "moe.bank", 0, 3, TOY["fused"])
    assert "cannot split the expert size 4 over 3 ranks" in _one_line(info)


def test_an_unknown_fused_kind_is_refused():
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_fused_experts(FusedBank(TOY["fused"]), "moe.bank", 0, 2, {**TOY["fused"], "kind": "rows_v9"})
    assert _one_line(info) == "moe.bank: unknown fused expert layout 'rows_v9': re-run patch"


def test_every_family_fused_kind_has_a_sharder():
    assert {f.fused.kind for f in FAMILIES.values()} <= set(rt.FUSED_SHARDERS)


# ------------------------------------------------------------------- interleaved columns, expert biases


#: a made-up transposed, interleaved, biased fused layout: none of these names is a real family's
INTERLEAVED = {"kind": "gate_up_interleaved_cols", "gate_up": "w_in", "down": "w_out", "size_attr": "units",
               "gate_up_bias": "b_in", "down_bias": "b_out"}


class InterleavedBank(nn.Module):
    """gate_up [E, H, 2I] (gate = ::2, up = 1::2), down [E, I, H], biases; a clamped SwiGLU like gpt-oss's."""

    limit, alpha = 1.5, 1.7

    def __init__(self, scale=1.0):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(E, H, 2 * I) * scale)
        self.b_in = nn.Parameter(torch.randn(E, 2 * I) * scale)
        self.w_out = nn.Parameter(torch.randn(E, I, H))
        self.b_out = nn.Parameter(torch.randn(E, H))
        self.units = I

    def forward(self, x, weights):
        out = torch.zeros_like(x)
        for e in range(E):
            gate_up = x @ self.w_in[e] + self.b_in[e]
            gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
            out = out + weights[:, e:e + 1] * (((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.w_out[e]
                                               + self.b_out[e])
        return out


def _shard_copies(full, world, names):
    banks = []
    for rank in range(world):
        bank = copy.deepcopy(full)
        rt.shard_fused_experts(bank, "moe.bank", rank, world, names)
        banks.append(bank)
    return banks


def test_interleaved_shards_keep_each_gate_up_pair_on_one_rank():
    full = InterleavedBank()
    banks = _shard_copies(full, 2, INTERLEAVED)
    for rank, bank in enumerate(banks):
        lo, hi = rank * I // 2, (rank + 1) * I // 2
        assert bank.units == I // 2 and getattr(bank, rt.SHARDED_FLAG) is True
        # this rank's gates and ups are units [lo, hi) of the full ones, still interleaved
        assert torch.equal(bank.w_in[..., ::2], full.w_in[..., ::2][..., lo:hi])
        assert torch.equal(bank.w_in[..., 1::2], full.w_in[..., 1::2][..., lo:hi])
        assert torch.equal(bank.b_in[..., ::2], full.b_in[..., ::2][..., lo:hi])
        assert torch.equal(bank.w_out, full.w_out[:, lo:hi])
    assert torch.equal(torch.cat([b.w_in for b in banks], dim=2), full.w_in)
    assert torch.equal(torch.cat([b.b_in for b in banks], dim=1), full.b_in)
    assert torch.equal(torch.cat([b.w_out for b in banks], dim=1), full.w_out)


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_shards_sum_to_the_full_experts_through_the_clamped_activation(world):
    torch.manual_seed(3)
    full = InterleavedBank(scale=3.0)
    x, weights = torch.randn(7, H), torch.softmax(torch.randn(7, E), dim=-1)
    gate_up = torch.einsum("th,ehi->eti", x, full.w_in) + full.b_in[:, None]
    assert (gate_up.abs() > InterleavedBank.limit).any()  # the clamps do act on these inputs
    with torch.no_grad():
        expected = full(x, weights)
        parts = [bank(x, weights) for bank in _shard_copies(full, world, INTERLEAVED)]
    torch.testing.assert_close(sum(parts), expected, rtol=1e-5, atol=1e-5)


def test_the_down_bias_is_counted_once_over_the_ranks():
    full = InterleavedBank()
    with torch.no_grad():
        full.w_out.zero_()  # the experts' output is then their down bias alone
    banks = _shard_copies(full, 2, INTERLEAVED)
    assert torch.equal(banks[0].b_out, full.b_out) and torch.equal(banks[1].b_out, torch.zeros(E, H))
    x, weights = torch.randn(5, H), torch.softmax(torch.randn(5, E), dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(banks[0](x, weights) + banks[1](x, weights), full(x, weights))


def test_gate_up_rows_with_biases_split_them_with_the_rows():
    names = {**TOY["fused"], "gate_up_bias": "b13", "down_bias": "b2"}
    full = FusedBank(TOY["fused"])
    full.b13, full.b2 = nn.Parameter(torch.randn(E, 2 * I)), nn.Parameter(torch.randn(E, H))
    banks = _shard_copies(full, 2, names)
    gates = torch.cat([b.b13[:, :I // 2] for b in banks], dim=1)
    ups = torch.cat([b.b13[:, I // 2:] for b in banks], dim=1)
    assert torch.equal(torch.cat([gates, ups], dim=1), full.b13)
    assert torch.equal(banks[0].b2, full.b2) and not banks[1].b2.any()


def test_interleaved_layout_of_the_table_on_the_real_transformers_experts():
    """The table's interleaved family, its transformers MoE block: 2 ranks' partial outputs sum to the full one."""
    import importlib

    import transformers

    family = next(f for f in FAMILIES.values() if f.fused.kind == "gate_up_interleaved_cols")
    layout = family.policy_layout()
    module = importlib.import_module(family.builtin_module)
    config = getattr(transformers, family.config_class)(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                                        num_experts_per_tok=2, num_attention_heads=2)
    torch.manual_seed(5)
    block = getattr(module, layout["moe_classes"][0])(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 2.0)  # large enough that the activation's clamps act
    x = torch.randn(1, 6, H)
    with torch.no_grad():
        expected = block(x)[0]
        parts = []
        for rank in range(2):
            copy_ = copy.deepcopy(block)
            experts = getattr(copy_, layout["experts"])
            rt.shard_fused_experts(experts, "mlp.experts", rank, 2, layout["fused"])
            assert getattr(experts, layout["fused"]["size_attr"]) == I // 2
            parts.append(copy_(x)[0])
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ per-head attention params


def _deepspeed_rows(total, world, kv_heads):
    """Rows per rank DeepSpeed AutoTP gives a q/k/v projection of `total` rows (inference tp_grain_size 64)."""
    from deepspeed.module_inject import tp_shard

    name = "model.layers.0.self_attn.q_proj"
    if hasattr(tp_shard, "AutoTPMeta"):
        return tp_shard.get_shard_size_list(total, world, tp_shard.AutoTPMeta(num_kv_heads=kv_heads, tp_grain_size=64),
                                            name)
    tp_shard.set_num_kv_heads(kv_heads)
    tp_shard.set_tp_grain_size(64)
    return tp_shard.get_shard_size_list(total, world, name)


class RowsColumn(nn.Module):
    """A column-parallel projection keeping rows [start, start + count) of `linear`, as DeepSpeed's does."""

    def __init__(self, linear, start, count):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.data[start:start + count].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data[start:start + count].clone())

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


def _split_like_deepspeed(attention, names, kv_heads, world):
    """Per rank: a copy of `attention` with its q/k/v projections split by DeepSpeed's own row counts."""
    copies = []
    for rank in range(world):
        part = copy.deepcopy(attention)
        for attr in names:
            linear = getattr(part, attr)
            rows = _deepspeed_rows(linear.out_features, world, kv_heads)
            setattr(part, attr, RowsColumn(linear, sum(rows[:rank]), rows[rank]))
        copies.append(part)
    return copies


def _shard_heads_on_every_rank(models, layout, world):
    """Run shard_head_params on each simulated rank, the other ranks' head counts served by the fake gather."""
    owners = [rt.head_param_owners(m, layout) for m in models["full"]]
    for rank, (model, own) in enumerate(zip(models["parts"], owners)):
        for owner in own:  # the owners were recorded on the unsplit copy: point them at this rank's modules
            owner["module"] = model.get_submodule(owner["where"])
            owner["params"] = {a: getattr(owner["module"], a) for a in owner["params"]}
    counts = [torch.tensor([rt.local_head_count(o, RowsColumn) for o in own]) for own in owners]
    for rank, own in enumerate(owners):
        dist = FakeDist(world, rank)
        dist.peers = dict(enumerate(counts))
        rt.shard_head_params(own, dist, FakeGroup(range(world)), rank, world, RowsColumn)
    return counts


def test_head_params_follow_deepspeeds_uneven_split_of_the_heads():
    """6 heads in 3 kv groups over 2 ranks: DeepSpeed gives rank 0 two groups (4 heads), rank 1 one (2 heads)."""
    heads, kv, dim = 6, 3, 4
    layout = {"attention_head_params": ["sink_a", "sink_b"]}
    attention = nn.Module()
    attention.q = nn.Linear(8, heads * dim)
    attention.k = nn.Linear(8, kv * dim)
    attention.sink_a = nn.Parameter(torch.arange(heads, dtype=torch.float32))
    attention.sink_b = nn.Parameter(torch.arange(heads, dtype=torch.float32) * 10)
    model = nn.Sequential(attention)
    parts = [nn.Sequential(p) for p in _split_like_deepspeed(attention, ("q", "k"), kv, 2)]
    counts = _shard_heads_on_every_rank({"full": [model, model], "parts": parts}, layout, 2)
    assert [c.tolist() for c in counts] == [[4], [2]]
    assert parts[0][0].sink_a.tolist() == [0, 1, 2, 3] and parts[1][0].sink_a.tolist() == [4, 5]
    assert parts[1][0].sink_b.tolist() == [40, 50]


def test_head_params_whose_projections_disagree_are_one_line():
    owner = {"where": "layers.0.attn", "module": nn.Module(), "params": {"sinks": None}, "heads": 4,
             "rows": {"q": 64, "k": 32}}
    owner["module"].q = RowsColumn(nn.Linear(2, 64), 0, 32)  # 2 of 4 heads
    owner["module"].k = RowsColumn(nn.Linear(2, 32), 0, 24)  # 3 of 4 heads
    with pytest.raises(rt.PolicyError) as info:
        rt.local_head_count(owner, RowsColumn)
    assert _one_line(info).startswith("layers.0.attn: DeepSpeed's split of its projections is not a whole number")
    owner["module"] = nn.Module()  # no column-parallel projection at all
    with pytest.raises(rt.PolicyError) as info:
        rt.local_head_count(owner, RowsColumn)
    assert _one_line(info) == ("layers.0.attn: DeepSpeed split none of its projections by heads: "
                               "cannot shard sinks with the heads")
    with pytest.raises(rt.PolicyError) as info:
        rt.head_ranges([[2], [1]], 0, [owner])
    assert _one_line(info) == "layers.0.attn: the ranks hold [2, 1] of its 4 heads: cannot shard sinks with the heads"


def _gathering_dist(world, rank, widths_by_rank):
    dist = FakeDist(world, rank)
    dist.peers = {r: torch.tensor(w) for r, w in enumerate(widths_by_rank)}
    return dist


def test_per_head_linears_keep_the_rows_of_the_heads_deepspeed_left_on_the_rank():
    """An output gate with one row block per head, 6 heads in 3 kv groups over 2 ranks (4 heads, then 2): each rank
    keeps its heads' rows, at the offset the lower ranks' shares add up to; MLP linears of that name are not gates."""
    heads, kv, dim = 6, 3, 4
    layout = {"attention_head_linears": ["gate"], "attention_attrs": ["attn"]}
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.q, model.attn.k, model.attn.gate = nn.Linear(8, heads * dim), nn.Linear(8, kv * dim), nn.Linear(8, heads * dim)
    model.mlp = nn.Module()
    model.mlp.gate = nn.Linear(8, 16)
    full = model.attn.gate.weight.detach().clone()
    (owner,) = rt.head_linear_owners(model, layout)
    assert owner["where"] == "attn" and owner["linears"] == ["gate"] and owner["rows"] == {"q": 24, "k": 12}
    parts = _split_like_deepspeed(model.attn, ("q", "k"), kv, 2)
    widths = [[16], [8]]
    for rank, part in enumerate(parts):
        own = {**owner, "module": part}
        rt.slice_head_linears([own], _gathering_dist(2, rank, widths), FakeGroup(range(2)), rank, 2, RowsColumn)
    assert [p.gate.weight.shape[0] for p in parts] == [16, 8] and [p.gate.out_features for p in parts] == [16, 8]
    assert torch.equal(torch.cat([p.gate.weight for p in parts]), full)
    assert torch.equal(torch.cat([p.gate.bias for p in parts]), model.attn.gate.bias)


def test_full_width_norms_keep_each_ranks_heads_of_the_normed_output():
    """q normed over all 6 heads, the projection and the norm whole on every rank: concatenated over the ranks
    (4 heads, then 2), the own-heads outputs are the unsplit normed projection, bit for bit."""
    heads, kv, dim = 6, 3, 4
    attention = nn.Module()
    attention.q_proj, attention.k_proj = nn.Linear(8, heads * dim), nn.Linear(8, kv * dim)
    attention.v_proj = nn.Linear(8, kv * dim)
    attention.q_norm = nn.RMSNorm(heads * dim)
    with torch.no_grad():
        attention.q_norm.weight.normal_()
    layout = {"full_width_norms": [["q_norm", "q_proj"]]}
    (owner,) = rt.full_width_norm_owners(nn.Sequential(attention), layout)
    x = torch.randn(3, 8)
    expected = attention.q_norm(attention.q_proj(x))
    parts = _split_like_deepspeed(attention, ("k_proj", "v_proj"), kv, 2)
    outputs = []
    for rank, part in enumerate(parts):
        own = {**owner, "module": part}
        rt.slice_full_width_norms([own], _gathering_dist(2, rank, [[16], [8]]), FakeGroup(range(2)), rank, 2,
                                  RowsColumn)
        assert part.q_norm.weight.shape == (heads * dim,)  # the norm itself stays whole
        outputs.append(part.q_norm(part.q_proj(x)))
    assert [o.shape[-1] for o in outputs] == [16, 8]
    assert torch.equal(torch.cat(outputs, dim=-1), expected)
    narrow = {"where": "attn", "module": nn.Module(), "pairs": [("q_norm", "q_proj")], "rows": {"k_proj": 12}}
    narrow["module"].q_proj, narrow["module"].k_proj = nn.Linear(8, 20), RowsColumn(nn.Linear(8, 12), 0, 5)
    with pytest.raises(rt.PolicyError) as info:
        rt.slice_full_width_norms([narrow], FakeDist(2, 0), FakeGroup(range(2)), 0, 2, RowsColumn)
    assert _one_line(info) == ("attn.q_norm: this rank's share 5/12 of the heads is not a whole number of its "
                               "20 columns")


class _ParsedAutoTP:
    """DeepSpeed's AutoTP parser as the policy calls it: one (layer class, row layers) pair."""

    def __init__(self, gems):
        self.gems = gems

    def tp_parser(self, model):
        return [(nn.Module, list(self.gems))]


def test_row_layers_the_parser_got_wrong_for_per_expert_mlps_are_put_right():
    """Phi-3.5-MoE on 4.x: the parser names the last expert's up projection (before a LayerNorm) and no down one;
    the policy hands DeepSpeed every expert's down projection instead, and nothing where the parser is right."""
    block = nn.Module()
    block.experts = nn.ModuleList(nn.Module() for _ in range(3))
    blocks = [("layers.0.mlp", block)]
    layout = {"experts": "experts", "per_expert": {"gate": "w1", "up": "w3", "down": "w2"}}
    fixed = rt.row_layer_policy(nn.Module(), blocks, layout, _ParsedAutoTP(["2.w3", "self_attn.o_proj"]))
    assert fixed == {nn.Module: ("0.w2", "1.w2", "2.w2", "self_attn.o_proj")}
    right = _ParsedAutoTP(["0.w2", "1.w2", "2.w2", "self_attn.o_proj"])
    assert rt.row_layer_policy(nn.Module(), blocks, layout, right) is None
    assert rt.row_layer_policy(nn.Module(), [("m", nn.Module())], layout, right) is None  # fused: no ModuleList


def test_row_layers_keep_other_module_lists_linears_and_name_no_zero_compute_expert():
    """DeepSpeed names a linear by its parent's key, so LongCat's `self_attn.0.o_proj` reads `0.o_proj` like expert 0's
    projections: it stays a row layer; a zero-compute expert (`nn.Identity`) gets no `<i>.down_proj` (DeepSpeed
    refuses a name that matches nothing)."""
    block = nn.Module()
    block.experts = nn.ModuleList([nn.Module(), nn.Module(), nn.Identity()])
    blocks = [("layers.0.mlp", block)]
    layout = {"experts": "experts", "per_expert": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
              "identity_experts": ["Identity"]}
    parsed = _ParsedAutoTP(["0.o_proj", "1.o_proj", "0.up_proj"])
    fixed = rt.row_layer_policy(nn.Module(), blocks, layout, parsed)
    assert fixed == {nn.Module: ("0.down_proj", "0.o_proj", "1.down_proj", "1.o_proj")}
    right = _ParsedAutoTP(["0.o_proj", "1.o_proj", "0.down_proj", "1.down_proj"])
    assert rt.row_layer_policy(nn.Module(), blocks, layout, right) is None


def _identity_family():
    return next(f for f in FAMILIES.values() if f.identity_experts)


@pytest.mark.parametrize("world", [2, 4])
def test_zero_compute_experts_are_counted_once_over_the_group(world):
    """The table's zero-compute-expert family, its transformers experts: each rank's sharded experts plus (first rank
    only) the weighted token itself sum to the unsplit experts' output; without the rule the token counts twice."""
    import importlib

    import transformers

    from codegen import versions
    from codegen.families import EXAMPLES

    if versions.is_legacy(transformers.__version__):
        # 4.x keeps the experts in a ModuleList with `nn.Identity` entries, called by the block's own loop: that path
        # runs on real ranks in tests/test_verify.py under transformers 4.57.6
        pytest.skip("transformers 4.x: the zero-compute experts are ModuleList entries, checked on real ranks")
    family = _identity_family()
    module = importlib.import_module(family.builtin_module)
    config = getattr(transformers, family.config_class)(**EXAMPLES[family.model_type].tiny)
    torch.manual_seed(3)
    block = getattr(module, family.moe_classes[0])(config).eval()
    experts = getattr(block, family.experts_attr)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.5)
    x = torch.randn(6, config.hidden_size)
    routed = config.n_routed_experts
    # every token reaches one computing expert and one zero-compute expert
    index = torch.tensor([[e % routed, routed + e % config.zero_expert_num] for e in range(6)])
    weights = torch.rand(6, 2)
    full = experts(x, index, weights)
    layout = family.policy_layout()
    parts, unruled = [], []
    for rank in range(world):
        shard = copy.deepcopy(experts)
        rt.shard_fused_experts(shard, "experts", rank, world, layout["fused"])
        unruled.append(shard(x, index, weights))
        rt.count_identity_once(shard, "experts", rank, set(layout["identity_experts"]))
        parts.append(shard(x, index, weights))
    torch.testing.assert_close(sum(parts), full, rtol=1e-5, atol=1e-5)
    assert (sum(unruled) - full).abs().max() > 1e-2  # the token itself, counted once per rank
    assert type(getattr(shard, "identity_expert")).__name__ == "CountedOnAnotherRank"
    with pytest.raises(rt.PolicyError, match="no zero-compute expert"):
        rt.count_identity_once(nn.Module(), "experts", 1, {"Identity"})


def test_head_params_on_the_real_transformers_attention_match_the_unsplit_attention():
    """The table's head-param family, its transformers attention: 2 ranks' o-projection partial sums add up."""
    import importlib

    import transformers

    family = next(f for f in FAMILIES.values() if f.attention_head_params)
    module = importlib.import_module(family.builtin_module)
    config = getattr(transformers, family.config_class)(hidden_size=16, num_attention_heads=6, num_key_value_heads=3,
                                                        head_dim=4, intermediate_size=8, num_local_experts=2,
                                                        num_experts_per_tok=1)
    config._attn_implementation = "eager"
    attn_class = next(c for n, c in vars(module).items() if n.endswith("Attention") and isinstance(c, type))
    rotary_class = next(c for n, c in vars(module).items() if n.endswith("RotaryEmbedding"))
    torch.manual_seed(7)
    attention = attn_class(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in attention.parameters():
            param.normal_(0, 0.5)
    x = torch.randn(2, 5, 16)
    cos_sin = rotary_class(config=config)(x, torch.arange(5)[None].expand(2, -1))
    projections = [n for n, c in attention.named_children() if isinstance(c, nn.Linear)]
    out_proj = next(n for n in projections if getattr(attention, n).out_features == 16)
    columns = [n for n in projections if n != out_proj]
    parts = _split_like_deepspeed(attention, columns, 3, 2)
    _shard_heads_on_every_rank({"full": [attention, attention], "parts": parts}, family.policy_layout(), 2)
    with torch.no_grad():
        expected = attention(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)[0]
        total = 0
        for rank, part in enumerate(parts):
            full_o = getattr(attention, out_proj)
            start = sum(getattr(p, columns[0]).weight.shape[0] for p in parts[:rank])
            width = getattr(part, columns[0]).weight.shape[0]
            row = nn.Linear(width, 16, bias=rank == 0)  # row-parallel o projection, its bias added once
            row.weight.data = full_o.weight.data[:, start:start + width].clone()
            if rank == 0:
                row.bias.data = full_o.bias.data.clone()
            setattr(part, out_proj, row)
            total = total + part(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)[0]
    assert [p.sinks.shape[0] for p in parts] == [4, 2]
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_an_expert_deepspeed_left_unsharded_is_one_line_naming_it(with_fake_deepspeed):
    ds, _ = with_fake_deepspeed()
    model = _toy()
    original = ds.init_inference

    def leaves_one_expert(model, **kwargs):
        keep = model.moe.bank[1].w1
        engine = original(model, **kwargs)
        model.moe.bank[1].w1 = keep  # a DeepSpeed that skipped it
        return engine

    ds.init_inference = leaves_one_expert
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_model(model, 2, None, {}, TOY, "codegen_knob")
    assert _one_line(info) == ("moe.bank.1.w1 is Linear, not sharded by deepspeed.init_inference "
                               "as a column-parallel layer")


def test_a_shared_expert_the_table_does_not_name_is_refused(with_fake_deepspeed):
    """A row layer left reducing inside the block would be summed twice (x tp): refuse it."""
    with_fake_deepspeed()
    model = _toy()
    model.moe.extra_mlp = MLP(TOY["per_expert"])
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_model(model, 2, None, {}, TOY, "codegen_knob")
    assert _one_line(info) == ("moe.extra_mlp.w2 still reduces on its own inside the MoE block, which the family "
                               "layout does not name: the one reduction would add it again")


def test_a_block_that_is_a_decoder_layer_keeps_the_reductions_the_table_names(with_fake_deepspeed):
    """`block_reductions` (Gemma 4: the MoE block is the decoder layer): its dense MLP reduces on its own, outside
    the one reduction of the experts; any other row layer in the block is still refused."""
    with_fake_deepspeed()
    model = _toy()
    model.moe.extra_mlp = MLP(TOY["per_expert"])
    engine = rt.shard_model(model, 2, None, {}, {**TOY, "block_reductions": ["extra_mlp"]}, "codegen_knob")
    assert not rt.is_partial(engine.module.moe.extra_mlp.w2)


def test_knob_off_shards_nothing_itself_and_attaches_no_reducer(with_fake_deepspeed):
    with_fake_deepspeed()
    model = _toy(fused=True)
    model.config.codegen_knob = False
    rt.shard_model(model, 2, None, {}, TOY, "codegen_knob")
    assert model.moe.bank.w13.shape == (E, 2 * I, H)
    assert not hasattr(model.moe, rt.REDUCER_ATTR)
    assert type(model.moe.router) is Router  # routers are kept whole either way


def test_a_missing_router_is_refused(with_fake_deepspeed):
    with_fake_deepspeed()
    model = _toy()
    del model.moe.common_router
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_model(model, 2, None, {}, TOY, "codegen_knob")
    assert _one_line(info) == "moe has no router 'common_router' (named by the family table): re-run patch"


def test_routers_come_back_in_the_engine_dtype_and_a_changed_one_is_caught(with_fake_deepspeed):
    with_fake_deepspeed()
    model = _toy()
    kept = rt.detach_replicated(model, rt.moe_blocks(model, TOY), TOY)
    rt.fingerprint_kept(kept, torch.float64)
    assert [k["where"] for k in kept] == ["moe.router", "moe.common_router", "attn.kv_in"]
    assert "router" not in model.moe._modules and "kv_in" not in model.attn._modules
    model.to(torch.float64)
    rt.reattach(kept, torch.float64)
    assert model.moe.router.weight.dtype == torch.float64 and next(iter(model.moe._modules)) == "router"
    rt.check_replicated(kept)
    with torch.no_grad():
        model.moe.common_router.weight[0, 0] += 1
    with pytest.raises(rt.PolicyError) as info:
        rt.check_replicated(kept)
    assert _one_line(info) == "moe.common_router was split or changed by DeepSpeed: it must stay replicated"


def test_a_module_kept_whole_by_class_is_out_of_deepspeeds_sight_and_comes_back_unchanged(with_fake_deepspeed):
    """`whole_modules`: a token mixer whose head split is not exact stays whole on every rank (no collective)."""
    with_fake_deepspeed()
    model = _toy()
    layout = {**TOY, "attention_replicated": [], "whole_modules": ["ToyAttention"]}
    kept = rt.detach_replicated(model, rt.moe_blocks(model, layout), layout)
    rt.fingerprint_kept(kept, torch.float32)
    assert [k["where"] for k in kept] == ["moe.router", "moe.common_router", "attn"]
    assert "attn" not in model._modules and list(model._modules) == ["moe"]
    rt.reattach(kept, torch.float32)
    assert list(model._modules) == ["attn", "moe"] and type(model.attn) is ToyAttention
    rt.check_replicated(kept)
    with torch.no_grad():
        model.attn.o.weight[0, 0] += 1
    with pytest.raises(rt.PolicyError) as info:
        rt.check_replicated(kept)
    assert _one_line(info) == "attn was split or changed by DeepSpeed: it must stay replicated"


def test_reductions_stay_in_group_when_several_groups_share_the_shm_kernel():
    dist = FakeDist(world=4, rank=2)
    backend = types.SimpleNamespace(shm_comm_op=object(), inference_all_reduce="original")
    assert rt.route_inference_reductions(backend, dist, several_groups=False, shm_live=True) is None
    assert backend.inference_all_reduce == "original"
    assert rt.route_inference_reductions(backend, dist, several_groups=True, shm_live=True) is None
    group = FakeGroup([2, 3])
    backend.inference_all_reduce(torch.ones(2), "SUM", group)
    assert dist.calls == [("all_reduce", group, {"op": "SUM"})]


def test_a_shm_kernel_never_set_up_is_not_used():
    """DeepSpeed initialised without LOCAL_SIZE (or ranks on several nodes): its shm kernel would segfault at the
    first reduction; the policy reduces through torch.distributed and says so once."""
    backend = types.SimpleNamespace(shm_comm_op=object(), inference_all_reduce="original")
    note = rt.route_inference_reductions(backend, FakeDist(), several_groups=False, shm_live=False)
    assert isinstance(backend.inference_all_reduce, rt.GroupInferenceAllReduce)
    assert note.startswith("DeepSpeed's shared-memory all-reduce was not set up") and "\n" not in note
    gpu = types.SimpleNamespace(shm_comm_op=None, inference_all_reduce="nccl")
    assert rt.route_inference_reductions(gpu, FakeDist(), several_groups=False, shm_live=False) is None
    assert gpu.inference_all_reduce == "nccl"


def test_tp_groups_are_consecutive_ranks_and_a_bad_world_is_refused():
    dist = FakeDist(world=4, rank=3)
    mpu = rt.TensorParallelGroups(dist, 2)
    assert dist.groups == [[0, 1], [2, 3]] and mpu.get_model_parallel_group().ranks == [2, 3]
    assert (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()) == (2, 1)
    with pytest.raises(rt.PolicyError) as info:
        rt.TensorParallelGroups(FakeDist(world=3), 2)
    assert _one_line(info) == "world size 3 is not a multiple of tp_size 2"


def test_reducer_no_grad_path_and_autograd_path():
    dist = FakeDist()
    group = FakeGroup([0, 1])
    reducer = rt.CoalescedAllReduce(dist, group, 2)
    with torch.no_grad():
        reducer(torch.ones(3))
    x = torch.ones(3, requires_grad=True)
    y = reducer(x * 2)
    y.backward(torch.full((3,), 5.0))
    assert [(c[0], c[1]) for c in dist.calls] == [("inference_all_reduce", group), ("all_reduce", group)]
    assert type(y.grad_fn).__name__ == "_AllReduceSumBackward" and torch.equal(x.grad, torch.full((3,), 10.0))


def test_partial_row_layer_adds_its_bias_once():
    dist = FakeDist()
    linear = nn.Linear(4, 2)
    layers = [FakeRow(linear, rank, 2, dist) for rank in (0, 1)]
    for rank, layer in enumerate(layers):
        rt.make_partial(layer, f"rank{rank}.w2", FakeRow)
    x = torch.randn(3, 4)
    total = layers[0](x[:, :2]) + layers[1](x[:, 2:])
    torch.testing.assert_close(total, linear(x))
    assert dist.calls == []  # no reduction of its own
    with pytest.raises(rt.PolicyError) as info:
        rt.make_partial(nn.Linear(2, 2), "moe.bank.0.w2", FakeRow)
    assert _one_line(info).startswith("moe.bank.0.w2 is Linear, not sharded by deepspeed.init_inference")
    bare = FakeRow(linear, 0, 2, dist)
    del bare.tp_index
    with pytest.raises(rt.PolicyError) as info:
        rt.make_partial(bare, "moe.bank.0.w2", FakeRow)
    assert _one_line(info).startswith("DeepSpeed's row-parallel layer moe.bank.0.w2 has no tp_index: unsupported")


# ---------------------------------------------------------------------------------------------- checks


def test_sizes_are_read_from_text_config_when_nested():
    layout = FAMILIES["qwen2_moe"].policy_layout()
    key = layout["tp_divisible"][0]
    nested = types.SimpleNamespace(text_config=types.SimpleNamespace(**{key: 6}), **{key: 8})
    with pytest.raises(rt.PolicyError) as info:
        rt.check_sizes(nested, 4, layout)
    assert _one_line(info) == f"tp_size 4 does not divide {key} = 6: pick a tp_size that divides it"
    rt.check_sizes(types.SimpleNamespace(**{key: 8}), 4, layout)
    with pytest.raises(rt.PolicyError) as info:
        rt.check_sizes(types.SimpleNamespace(), True, layout)
    assert _one_line(info) == "tp_size must be a positive integer, got True"


def test_patched_family_and_module_are_checked():
    model = _toy()
    rt.check_patched(model, TOY, "toy_modeling_codegen")
    with pytest.raises(rt.PolicyError) as info:
        rt.check_patched(model, {**TOY, "family": "other"})
    assert _one_line(info) == "model was patched for 'toy', this policy is for 'other': re-run patch"
    with pytest.raises(rt.PolicyError) as info:
        rt.check_patched(model, TOY, "modeling_elsewhere_codegen")
    assert "this policy was written beside modeling_elsewhere_codegen.py" in _one_line(info)
    with pytest.raises(rt.PolicyError) as info:
        rt.check_patched(nn.Linear(1, 1), TOY)
    assert _one_line(info) == ("Linear (torch.nn.modules.linear) is not a class of a codegen-patched dir: load the "
                               "patched dir with from_pretrained(DIR, trust_remote_code=True)")
    unpatched = types.ModuleType("transformers_modules.some_dir.modeling_x")
    remote = type("XForCausalLM", (nn.Module,), {"__module__": unpatched.__name__})
    sys.modules[unpatched.__name__] = unpatched
    try:
        with pytest.raises(rt.PolicyError) as info:
            rt.check_patched(remote(), TOY)
    finally:
        del sys.modules[unpatched.__name__]
    assert _one_line(info).startswith("XForCausalLM comes from a model dir codegen has not patched: run "
                                      "`python -m codegen patch DIR`")


def test_a_layout_missing_keys_is_refused():
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_model(_toy(), 2, None, {}, {"family": "toy"}, "codegen_knob")
    assert _one_line(info).startswith("the policy's layout lacks moe_classes, experts")


def test_a_wrapper_with_no_forward_is_sharded_through_its_text_submodule():
    """The layout's `text_submodule` (Qwen3-Omni's thinker): DeepSpeed is handed that submodule alone, the wrapper's
    other top-level modules (a talker with its own MoE, a vocoder) are what stays whole; without the submodule the
    policy refuses in one line; a layout without one shards the model itself."""
    wrapper = nn.Module()
    wrapper.thinker, wrapper.talker, wrapper.code2wav = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    outer, sub, whole = rt.text_submodule(wrapper, {"text_submodule": "thinker"})
    assert outer is wrapper and sub is wrapper.thinker
    assert [n for n, _ in whole] == ["talker", "code2wav"]
    assert rt.text_submodule(wrapper, {}) == (wrapper, wrapper, [])
    with pytest.raises(rt.PolicyError) as info:
        rt.text_submodule(nn.Linear(2, 2), {"text_submodule": "thinker"})
    assert _one_line(info).startswith("Linear has no text submodule 'thinker': hand init_inference the whole model")
    rt.keep_whole(whole, wrapper.thinker, torch.bfloat16)
    assert wrapper.talker.weight.dtype == wrapper.code2wav.weight.dtype == torch.bfloat16
    assert wrapper.thinker.weight.dtype == torch.float32  # DeepSpeed's to convert, not this


# ----------------------------------------------------------------------------------------------- probe


def test_probe_names_every_missing_touch_point_in_one_line():
    dist = FakeDist()
    ds = fake_deepspeed(dist)
    ds.__name__ = "fake_deepspeed"
    rt.probe_deepspeed(ds)  # complete: nothing raised
    del ds.module_inject.layers.LinearAllreduce
    del ds.comm.comm.cdb.shm_comm_op
    ds.inference.config.DeepSpeedTPConfig.model_fields = {"tp_size": None, "mpu": None}
    with pytest.raises(rt.PolicyError) as info:
        rt.probe_deepspeed(ds)
    assert _one_line(info) == (
        "DeepSpeed 0.0-fake lacks what this policy relies on: deepspeed.comm.comm.cdb.shm_comm_op; "
        "deepspeed.module_inject.layers.LinearAllreduce; init_inference(tensor_parallel={'tp_group': ...}) "
        f"(supported: {rt.SUPPORTED_DEEPSPEED})")


def test_the_installed_deepspeed_passes_the_probe_and_names_its_buffer_as_expected():
    import deepspeed

    assert rt.shm_naming_problems(os.path.dirname(deepspeed.__file__)) == []
    missing = [n for n in ("LinearAllreduce", "LinearLayer") if not hasattr(deepspeed.module_inject.layers, n)]
    assert missing == []


def test_the_probe_reports_a_changed_buffer_naming(tmp_path):
    import deepspeed

    package = Path(deepspeed.__file__).parent
    for parts in rt.SHM_SOURCES:
        target = tmp_path.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(package.joinpath(*parts).read_text())
    assert rt.shm_naming_problems(str(tmp_path)) == []
    shm = tmp_path.joinpath(*next(iter(rt.SHM_SOURCES)))
    shm.write_text(shm.read_text().replace('"%s_%d_%s_%s"', '"%s_%s_%s_%d"'))
    problems = rt.shm_naming_problems(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith("ops/csrc/cpu/comm/shm.cpp: the buffer naming")
    dist = FakeDist()
    ds = fake_deepspeed(dist)
    ds.__name__, ds.__file__ = "fake_deepspeed", str(tmp_path / "__init__.py")
    with pytest.raises(rt.PolicyError) as info:
        rt.probe_deepspeed(ds, shm_in_use=True)
    assert "ops/csrc/cpu/comm/shm.cpp: the buffer naming" in _one_line(info)


# ------------------------------------------------------------------------------------------ shared memory


def _maps(*paths):
    return "".join(f"7f00-7f10 rw-s 00000000 00:1a 123 {p}\n" for p in paths) + "7f20-7f30 r-xp 0 08:01 9 /usr/lib/x.so\n"


def test_own_buffer_is_found_by_its_derived_name_or_the_naming_change_is_reported():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"}
    name = rt.shm_buffer_name(1, env)
    assert name == f"deepspeed_allreduce_buffer_{os.getuid()}_10.0.0.1_29511_1"
    own = f"/dev/shm/{name}"
    other = f"/dev/shm/{rt.shm_buffer_name(0, env)}"
    assert rt.own_shm_buffer(1, _maps(other, own), env) == own
    assert rt.own_shm_buffer(1, _maps(), env) is None  # the shm path is not in use
    assert rt.own_shm_buffer(1, _maps(own + " (deleted)"), env) is None
    with pytest.raises(rt.PolicyError) as info:
        rt.own_shm_buffer(1, _maps("/dev/shm/deepspeed_allreduce_buffer_v2_x_1"), env)
    assert _one_line(info).startswith("DeepSpeed's shared-memory all-reduce maps /dev/shm/deepspeed_allreduce_buffer_v2")


def test_the_buffer_name_goes_after_the_barrier_and_only_if_it_is_still_the_same_file(tmp_path):
    path = tmp_path / "buffer"
    path.write_bytes(b"x")
    order = []
    assert rt.unlink_once_mapped(str(path), lambda: order.append("barrier")) is True
    assert order == ["barrier"] and not path.exists()
    path.write_bytes(b"x")

    def another_job_takes_the_name():
        os.rename(path, tmp_path / "held")  # keeps the first inode alive
        path.write_bytes(b"y")

    assert rt.unlink_once_mapped(str(path), another_job_takes_the_name) is False
    assert path.read_bytes() == b"y"
    assert rt.unlink_once_mapped(str(tmp_path / "absent"), lambda: None) is False


def test_mapped_buffers_are_seen_named_or_unlinked():
    assert rt.maps_shm_buffers(_maps("/dev/shm/deepspeed_allreduce_buffer_0_a_1_0 (deleted)")) is True
    assert rt.maps_shm_buffers(_maps("/dev/shm/deepspeed_allreduce_buffer_0_a_1_0")) is True
    assert rt.maps_shm_buffers(_maps()) is False


# ---------------------------------------------------------------------------------- the rank's process


def test_a_plain_process_at_tp1_becomes_a_local_group_of_one_and_more_ranks_need_a_launcher():
    env = {}
    notes, problem = rt.launcher_notes(1, env)
    assert problem is None and env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["MASTER_PORT"].isdigit() and env["TORCH_EXTENSIONS_DIR"] == rt.extensions_dir({})
    assert notes == ["no launcher: running as the one rank of a local group (tp_size 1)"]
    notes, problem = rt.launcher_notes(2, {})
    assert "tp_size 2 needs 2 ranks" in problem and "deepspeed --num_gpus 2" in problem and "\n" not in problem


def test_local_size_comes_from_torchruns_local_world_size_only_on_one_node():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    notes, problem = rt.launcher_notes(2, torchrun)
    assert problem is None and torchrun["LOCAL_SIZE"] == "2" and notes[0].startswith("LOCAL_SIZE set to 2")
    two_nodes = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    rt.launcher_notes(2, two_nodes)
    assert "LOCAL_SIZE" not in two_nodes  # not every rank is local: DeepSpeed's shm kernel must stay off
    deepspeed_launcher = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "TORCH_EXTENSIONS_DIR": "/x"}
    assert rt.launcher_notes(2, deepspeed_launcher) == ([], None) and deepspeed_launcher["TORCH_EXTENSIONS_DIR"] == "/x"


def test_threads_are_the_ranks_share_of_the_cores_unless_omp_num_threads_says():
    class FakeTorch:
        threads = 64

        def get_num_threads(self):
            return self.threads

        def set_num_threads(self, n):
            self.threads = n

    fake = FakeTorch()
    note = rt.thread_note(fake, 2, {})
    assert fake.threads == max(1, rt.usable_cores() // 2) and "OMP_NUM_THREADS is unset" in note
    fake.threads = 64
    assert rt.thread_note(fake, 2, {"OMP_NUM_THREADS": "7"}) is None and fake.threads == 64
    assert rt.local_ranks({"LOCAL_WORLD_SIZE": "4"}) == 4 and rt.local_ranks({}, world=3) == 3


#: a process that frees a 64 MiB block, then allocates and fills one again: the page faults of the second
_REFAULTS = """
import resource, sys
from codegen.policy.runtime.environment import malloc_note
print(malloc_note({}) if sys.argv[1] == "kept" else None)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = bytearray(64 << 20)
del block
before = faults()
block = bytearray(64 << 20)
print(faults() - before)
"""


def test_freed_large_blocks_are_reused_without_page_faults_on_a_cpu_rank():
    """The measured outcome: a 64 MiB block allocated again after a free page-faults in afresh (16,384 pages) by
    default, and hardly at all once malloc_note has run."""
    import platform
    import subprocess

    if platform.libc_ver()[0] != "glibc":
        assert rt.malloc_note({}) is None  # not glibc's malloc: left alone
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    runs = {how: subprocess.run([sys.executable, "-c", _REFAULTS, how], capture_output=True, text=True, env=env,
                                check=True).stdout.splitlines() for how in ("default", "kept")}
    assert runs["default"][0] == "None" and int(runs["default"][1]) > 8000
    assert "freed blocks up to 1 GiB are kept" in runs["kept"][0] and int(runs["kept"][1]) < 1000


def test_an_explicit_allocator_choice_is_left_as_it_is():
    assert rt.malloc_note({"MALLOC_MMAP_THRESHOLD_": "131072"}) is None
    assert rt.malloc_note({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) is None
    assert rt.malloc_note({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) is None


def _huge_pages_at(address):
    """The AnonHugePages (kB) of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_a_cpu_ranks_large_weights_move_into_huge_pages_where_linux_grants_them():
    """Weights of a huge page or more move into 2 MiB pages, values and strides kept, the same Parameters; small
    weights and views of another storage stay; CODEGEN_HUGE_PAGES=0, or Linux's `never`, leaves everything."""
    model = torch.nn.Module()
    model.big = torch.nn.Parameter(torch.randn(1024, 1536))
    model.flipped = torch.nn.Parameter(torch.randn(3, 1024, 512).transpose(1, 2))  # GPT-OSS's experts, re-laid
    model.small = torch.nn.Parameter(torch.randn(16, 16))
    whole = torch.randn(2048, 1024)
    model.view = torch.nn.Parameter(whole[:1024])
    before = {name: (p, p.detach().clone(), p.stride(), p.data_ptr()) for name, p in model.named_parameters()}
    assert rt.huge_page_weights(model, {"CODEGEN_HUGE_PAGES": "0"}) is None
    assert all(p.data_ptr() == ptr for p, _v, _s, ptr in before.values())
    mode = Path(rt.THP_MODE).read_text() if Path(rt.THP_MODE).exists() else "[never]"
    note = rt.huge_page_weights(model, {})
    if "[never]" in mode:
        assert note is None
        return
    page = int(Path(rt.THP_SIZE).read_text())
    assert note.startswith(f"12 MiB of weights in {page >> 20} MiB pages")
    params = dict(model.named_parameters())
    for name, (param, values, stride, pointer) in before.items():
        assert params[name] is param and torch.equal(param, values) and param.stride() == stride, name
        assert (param.data_ptr() != pointer) == (name in ("big", "flipped")), name
    assert model.big.data_ptr() % page == 0 and model.flipped.untyped_storage().nbytes() == model.flipped.nbytes
    assert _huge_pages_at(model.big.data_ptr()) >= page >> 10  # Linux granted at least one


def test_the_op_build_dir_is_per_environment(tmp_path):
    a = rt.extensions_dir({"XDG_CACHE_HOME": "/c"}, "/envs/a/.venv")
    b = rt.extensions_dir({"XDG_CACHE_HOME": "/c"}, "/envs/b/.venv")
    assert a != b and a.startswith("/c/torch_extensions/codegen-.venv-") and b.startswith("/c/torch_extensions/")
    # one environment reached through links (two checkouts linking one cached virtualenv): one build dir
    (tmp_path / "cached-env").mkdir()
    for clone in ("one", "two"):
        (tmp_path / clone).mkdir()
        (tmp_path / clone / ".venv").symlink_to(tmp_path / "cached-env")
    linked = {rt.extensions_dir({"XDG_CACHE_HOME": "/c"}, str(tmp_path / clone / ".venv")) for clone in ("one", "two")}
    assert linked == {rt.extensions_dir({"XDG_CACHE_HOME": "/c"}, str(tmp_path / "cached-env"))}


def test_fingerprints_are_exact_and_tell_different_inputs_apart():
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(rt.fingerprint([ids, {"attention_mask": torch.ones(1, 3)}]),
                       rt.fingerprint([ids.clone(), {"attention_mask": torch.ones(1, 3)}]))
    assert not torch.equal(rt.fingerprint([ids]), rt.fingerprint([torch.tensor([[1, 3, 2]])]))  # same sum, order differs
    assert rt.fingerprint([]).tolist() == [0.0]


def test_a_group_too_wide_to_sum_digits_compares_through_an_all_gather():
    """The comparison a group of more than MOST_RANKS_SUMMED ranks falls back to."""

    class GatheringDist(FakeDist):
        """Two ranks; the other rank's tensors are `peer(own)`."""

        def __init__(self, peer):
            super().__init__(world=2, rank=0)
            self.peer = peer

        def all_gather(self, tensors, tensor, group=None):
            tensors[0].copy_(tensor)
            tensors[1].copy_(self.peer(tensor))

    same = rt.Lockstep(GatheringDist(lambda t: t), None, torch.device("cpu"))
    same.check_same(torch.tensor([1.0, 2.0]), "x")  # equal: nothing raised
    other = rt.Lockstep(GatheringDist(lambda t: t + 1), None, torch.device("cpu"))
    with pytest.raises(rt.PolicyError) as info:
        other.check_same(torch.tensor([5]), "were given different inputs to generate")
    assert _one_line(info).startswith("the ranks of a tensor-parallel group were given different inputs to generate")


def _summed_digits(per_rank):
    return sum(rt.byte_digits(torch.tensor(tokens)) for tokens in per_rank)


@pytest.mark.parametrize("per_rank, agree", [
    ([[5, 17], [5, 17]], True),
    ([[0, 2**40 + 3, 151_935]] * 7, True),
    ([[5, 17], [5, 18]], False),
    ([[1, 3], [3, 1]], False),  # the same multiset of tokens, at other rows
    ([[2], [0], [1]], False),  # the same sum over ranks as [1] three times
    ([[2], [0], [1], [1]], False),
    ([[-1], [-1]], True),  # a pad id below zero: its bytes, two's complement
    ([[7]] * 257 + [[6]], False),  # one rank of 258 off by one
])
def test_the_step_token_check_is_exact_from_summed_digits(per_rank, agree):
    assert rt.digits_agree(_summed_digits(per_rank), len(per_rank)) is agree


def test_the_step_tokens_are_read_whatever_their_strides():
    step = torch.tensor([[4, 9, 300]]).expand(1, 3)[:, -1]  # generate's input_ids[:, -1] at batch 1: stride 3
    assert torch.equal(rt.byte_digits(step), rt.byte_digits(torch.tensor([300])))


class SummingDist(FakeDist):
    """Rank 0 of two through the inference all-reduce: each reduction adds what the other rank gave, `peer(own)`."""

    def __init__(self, peer=lambda own: own):
        super().__init__(world=2, rank=0)
        self.peer = peer

    def inference_all_reduce(self, tensor, group=None):
        super().inference_all_reduce(tensor, group)
        tensor.add_(self.peer(tensor.clone()))


def test_the_step_token_check_rides_on_the_groups_inference_all_reduce():
    same = SummingDist()
    rt.Lockstep(same, None, torch.device("cpu")).check_same_tokens(torch.tensor([3, 9]))
    assert same.calls == [("inference_all_reduce", None, {})]  # one reduction, no all-gather
    other = SummingDist(lambda own: rt.byte_digits(torch.tensor([3, 8])))
    with pytest.raises(rt.PolicyError) as info:
        rt.Lockstep(other, None, torch.device("cpu")).check_same_tokens(torch.tensor([3, 9]))
    assert _one_line(info).startswith("the ranks of a tensor-parallel group chose different tokens while generating")


def test_generate_begins_with_the_first_ranks_random_state_and_the_same_inputs():
    state_bytes = torch.get_rng_state().numel()

    def peer_with(inputs):
        """The other rank: no random state of its own to share (zeros), `inputs` fingerprinted."""
        return lambda own: torch.cat([torch.zeros(state_bytes), rt.byte_digits(rt.input_digest(inputs))])

    ids = torch.tensor([[1, 2, 3]])
    torch.manual_seed(7)
    expected = torch.get_rng_state()
    same = SummingDist(peer_with([ids]))
    rt.Lockstep(same, None, torch.device("cpu")).begin([ids])
    assert [c[0] for c in same.calls] == ["inference_all_reduce"]  # one reduction: no broadcast, no all-gather
    assert torch.equal(torch.get_rng_state(), expected)  # rank 0's own state, back from the sum unchanged
    for inputs in ([torch.tensor([[1, 2, 4]])], [ids, ids]):  # other values; another count of tensors
        with pytest.raises(rt.PolicyError) as info:
            rt.Lockstep(SummingDist(peer_with(inputs)), None, torch.device("cpu")).begin([ids])
        assert _one_line(info).startswith("the ranks of a tensor-parallel group were given different inputs")


# ------------------------------------------------------------------------------------- the rendered file


def test_rendered_policy_is_header_plus_runtime_and_records_its_sha256():
    runtime = runtime_text()
    for family in FAMILIES.values():
        text = family_policy(family, "modeling_x", legacy=False)
        header, embedded = split_policy(text)
        auto_class = next(iter(family.auto_classes))
        assert text == render_header(family.policy_layout(), auto_class, KNOB, "modeling_x",
                                     hashlib.sha256(runtime.encode()).hexdigest()) + runtime
        assert embedded == runtime and header.endswith(SEPARATOR)
        namespace = {node.targets[0].id: ast.literal_eval(node.value)
                     for node in ast.parse(header).body if isinstance(node, ast.Assign)}
        assert namespace["RUNTIME_SHA256"] == hashlib.sha256(embedded.encode()).hexdigest()
        assert namespace["LAYOUT"] == family.policy_layout() and namespace["MODELING_MODULE"] == "modeling_x"


def test_generated_policies_embed_the_runtime_verbatim():
    runtime = runtime_text()
    files = sorted(ROOT.glob("generated/**/autotp_policy.py"))
    assert len(files) >= 3
    for path in files:
        header, embedded = split_policy(path.read_text(encoding="utf-8"))
        recorded = re.search(r"^RUNTIME_SHA256 = '([0-9a-f]{64})'$", header, re.MULTILINE).group(1)
        assert embedded == runtime, f"{path}: regenerate (python -m codegen regression regenerate)"
        assert recorded == hashlib.sha256(embedded.encode()).hexdigest()


def test_the_runtime_is_self_contained_and_holds_no_family_name():
    text = runtime_text()
    tree = ast.parse(text)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) <= {"torch", "deepspeed", "transformers"}
    assert "__future__" not in imported and len(text.splitlines()) >= 100
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    for family in FAMILIES.values():
        layout = family.policy_layout()
        names = {layout["family"], layout["experts"], *layout["moe_classes"], *layout["shared"], *layout["routers"],
                 *layout["attention_replicated"], *layout["tp_divisible"], *layout["per_expert"].values(),
                 layout["fused"]["gate_up"], layout["fused"]["down"], layout["fused"]["size_attr"],
                 layout["fused"].get("latent_in", ""), layout["fused"].get("latent_out", "")} - {""}  # "": none
        schema = {*layout, *layout["per_expert"], *layout["fused"]}  # the layout's own keys, not family names
        assert not literals & (names - schema), literals & (names - schema)


def test_the_runtime_is_its_parts_in_order_and_each_part_is_a_module_of_the_same_code():
    import importlib

    text = runtime_text()
    at = 0
    for name in PARTS:
        start = text.index(PART_HEADER.format(name), at)
        assert start >= at
        at = start
        module = importlib.import_module(f"codegen.policy.runtime.{name}")
        for node in ast.parse(part_text(name)).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                # the assembled runtime defines the very same function / class the part module does
                assert ast.get_source_segment(part_text(name), node) in text
                assert hasattr(module, node.name) and hasattr(rt, node.name)
    leaves = [n for n in PARTS if "from codegen." not in part_text(n)]
    assert "probe" in leaves and all(part_text(n) in text for n in leaves)  # leaf parts embedded byte for byte


def test_a_part_importing_a_name_no_earlier_part_defines_is_refused(monkeypatch):
    from codegen.policy import assemble

    real = assemble.part_text
    monkeypatch.setattr(assemble, "part_text", lambda name: real(name) + (
        "\nfrom codegen.policy.runtime.entry import init_inference\n" if name == "groups" else ""))
    assemble.runtime_text.cache_clear()
    try:
        with pytest.raises(AssemblyError, match="runtime part groups imports .'init_inference'. from"):
            assemble.runtime_text()
    finally:
        assemble.runtime_text.cache_clear()


def test_a_part_redefining_a_name_an_earlier_part_defines_is_refused(monkeypatch):
    """In the one assembled file the later definition would replace the earlier part's for every part (a decode
    attention part's `REPLACED` once turned the fused experts off this way, silently)."""
    from codegen.policy import assemble

    real = assemble.part_text
    monkeypatch.setattr(assemble, "part_text", lambda name: real(name) + (
        '\nREPLACED = "eager"\n' if name == "kv_cache" else ""))
    assemble.runtime_text.cache_clear()
    try:
        with pytest.raises(AssemblyError, match=r"runtime part kv_cache defines \['REPLACED'\], which an earlier"):
            assemble.runtime_text()
    finally:
        assemble.runtime_text.cache_clear()


# ------------------------------------------------------------------------------------------- linear attention


def _gated_delta_net(family: str):
    """The family's real linear-attention module (transformers' own class, its tiny example's config), random."""
    import importlib

    from codegen.harness.examples import example_config

    row = FAMILIES[family]
    config = example_config(family)
    config = getattr(config, "text_config", config)
    module = importlib.import_module(row.builtin_module)
    layer = next(i for i, kind in enumerate(config.layer_types) if kind == "linear_attention")
    decoder = getattr(module, next(n for n in dir(module) if n.endswith("DecoderLayer")))(config, layer)
    mixer = getattr(decoder, row.linear_attention.attr)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.2)
    return decoder, mixer


class _Collect:
    """Stands in for the group all-reduce: records each partial sum, returns it unchanged."""

    def __init__(self):
        self.partials = []

    def __call__(self, tensor):
        self.partials.append(tensor)
        return tensor


def _hybrids() -> list[str]:
    from codegen.harness.examples import installed_families

    return [f for f in installed_families() if FAMILIES[f].linear_attention is not None]


@pytest.mark.parametrize("family", _hybrids())
@pytest.mark.parametrize("world", [2, 4])
def test_linear_attention_sharded_by_heads_sums_to_the_whole_layer(family, world):
    """Each rank's copy keeps its key heads (and their value heads) of every tensor; the ranks' out_proj partial
    sums add up to the unsharded layer's output, and each issued exactly one reduction."""
    decoder, mixer = _gated_delta_net(family)
    layout = FAMILIES[family].policy_layout()
    x = torch.randn(2, 7, mixer.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = mixer(x)
    total = torch.zeros_like(whole)
    for rank in range(world):
        copy_ = copy.deepcopy(decoder)
        (found,) = rt.linear_attention_modules(copy_, layout)
        collect = _Collect()
        rt.shard_linear_attention([found], layout, rank, world, collect)
        own = found[2]
        assert own.num_k_heads * world == mixer.num_k_heads and own.num_v_heads * world == mixer.num_v_heads
        assert own.conv1d.weight.shape[0] * world == mixer.conv1d.weight.shape[0] == own.conv1d.groups * world
        assert own.out_proj.weight.shape[1] * world == mixer.out_proj.weight.shape[1]
        for name in getattr(own, rt.SHARDED_TENSORS):
            param = own.get_parameter(name)
            assert isinstance(param, nn.Parameter) and param.numel() * world == mixer.get_parameter(name).numel()
        with torch.no_grad():
            out = own(x)
        assert len(collect.partials) == 1 and collect.partials[0] is out
        total += out
    assert (total - whole).abs().max().item() < 1e-5


def test_linear_attention_a_size_the_ranks_cannot_split_is_one_line():
    decoder, mixer = _gated_delta_net("qwen3_next")
    layout = FAMILIES["qwen3_next"].policy_layout()
    found = rt.linear_attention_modules(decoder, layout)
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_linear_attention(found, layout, 0, 3, _Collect())
    assert "does not split over 3 ranks" in _one_line(info)


def test_linear_attention_segments_that_do_not_cover_a_projection_are_one_line():
    decoder, mixer = _gated_delta_net("qwen3_next")
    layout = FAMILIES["qwen3_next"].policy_layout()
    spec = copy.deepcopy(layout["linear_attention"])
    spec["projections"][0][1] = ["key_dim", "value_dim"]  # the q|k|v|z groups named as two segments
    found = rt.linear_attention_modules(decoder, {"linear_attention": spec})
    with pytest.raises(rt.PolicyError) as info:
        rt.shard_linear_attention(found, {"linear_attention": spec}, 0, 2, _Collect())
    assert "in_proj_qkvz" in _one_line(info) and "re-run patch" in _one_line(info)


def test_deepspeeds_parse_covers_every_kind_of_hybrid_layer():
    """DeepSpeed's parser reads the first layer of a class only; a hybrid's full-attention layer (not first) gets
    its `o_proj` named a row layer by the united parse."""

    class Layer(nn.Module):
        def __init__(self, full):
            super().__init__()
            if full:
                self.self_attn = nn.Module()
                self.self_attn.o_proj = nn.Linear(4, 4)
            else:
                self.mixer = nn.Linear(4, 4)
            self.mlp = nn.Module()
            self.mlp.down_proj = nn.Linear(4, 4)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(False), Layer(True), Layer(False)])

    class FirstOnly:  # DeepSpeed's way: the first layer of each class, its linears named `*_proj`
        @staticmethod
        def tp_parser(model):
            first = next(iter(model.layers))
            return [(type(first), [f".{n}" for n, m in first.named_modules() if n.endswith(("o_proj", "down_proj"))])]

    model = Model()
    order = list(model.layers._modules)
    fixed = rt.row_layer_policy(model, [], {"experts": "experts", "per_expert": {"down": "down_proj"}}, FirstOnly)
    assert fixed == {Layer: (".mlp.down_proj", ".self_attn.o_proj")}
    assert list(model.layers._modules) == order  # the layers are back in their order


# --------------------------------------------- transformers' experts implementations on codegen's shards


def _experts_implementations() -> list[str]:
    """The experts implementations the installed transformers offers besides its eager loop (5.x)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return []
    return sorted(ALL_EXPERTS_FUNCTIONS.keys())


def test_transformers_experts_implementations_run_on_codegens_shards():
    """transformers 5.x dispatches a fused experts module to `grouped_mm` / `batched_mm` by its config: on the
    policy's shards (1/tp of every expert's intermediate width) each runs, and the ranks' partial outputs add up to
    the unsharded module's (so `from_pretrained(..., experts_implementation=...)` composes with the policy)."""
    import importlib

    from codegen.harness.examples import example_config, installed_families

    implementations = _experts_implementations()
    family = "qwen3_moe"
    if family not in installed_families() or not implementations:  # 4.x: experts are per-expert MLPs
        import transformers

        assert int(transformers.__version__.split(".")[0]) < 5
        return
    assert {"grouped_mm", "batched_mm"} <= set(implementations)
    row = FAMILIES[family]
    config = example_config(family)
    module = importlib.import_module(row.builtin_module)
    experts = getattr(module, next(n for n in dir(module) if n.endswith("Experts") and n.startswith("Qwen3Moe")))(
        config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    tokens = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(1))
    index = torch.randint(0, config.num_experts, (12, 2), generator=torch.Generator().manual_seed(2))
    weights = torch.rand(12, 2, generator=torch.Generator().manual_seed(3))
    fused = row.policy_layout()["fused"]
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        config._experts_implementation = implementation
        with torch.no_grad():
            whole = experts(tokens, index, weights)
            total = torch.zeros_like(whole)
            for rank in range(2):
                shard = copy.deepcopy(experts)
                rt.shard_fused_experts(shard, "mlp.experts", rank, 2, fused)
                total += shard(tokens, index, weights)
        assert (total - whole).abs().max().item() < 1e-5, implementation


def test_flat_row_experts_keep_each_experts_rows_of_gate_up_and_down_and_sum_to_the_whole():
    """FUSED_FLAT_ROWS (DBRX): gate, up, down [E*I, H] one module down; each rank keeps I/world rows of every
    expert in all three, the width attribute becomes the shard, and the ranks' partial outputs add up exactly."""
    import torch

    from codegen.policy.runtime.base import FUSED_FLAT_ROWS
    from codegen.policy.runtime.experts import shard_fused_experts

    E, I, H, world = 3, 4, 5, 2
    torch.manual_seed(0)
    full = {n: torch.randn(E * I, H) for n in ("w1", "v1", "w2")}
    names = {"kind": FUSED_FLAT_ROWS, "gate_up": "mlp.w1", "up": "mlp.v1", "down": "mlp.w2",
             "size_attr": "ffn_hidden_size", "gate_up_bias": "", "down_bias": ""}

    def expert_out(mod, x, e, inter):
        view = lambda p: p.view(E, inter, H)[e]
        return (torch.nn.functional.silu(x @ view(mod.mlp.w1).T) * (x @ view(mod.mlp.v1).T)) @ view(mod.mlp.w2)

    x = torch.randn(2, H)
    total = torch.zeros(2, H)
    for rank in range(world):
        mod = torch.nn.Module()
        mod.mlp = torch.nn.Module()
        for n, t in full.items():
            setattr(mod.mlp, n, torch.nn.Parameter(t.clone()))
        mod.ffn_hidden_size = I
        shard_fused_experts(mod, "experts", rank, world, names)
        assert mod.ffn_hidden_size == I // world and mod.mlp.w2.shape == (E * I // world, H)
        total += expert_out(mod, x, 1, I // world)
    whole = torch.nn.Module()
    whole.mlp = torch.nn.Module()
    for n, t in full.items():
        setattr(whole.mlp, n, torch.nn.Parameter(t))
    torch.testing.assert_close(total, expert_out(whole, x, 1, I))


def test_non_gated_experts_behind_latent_projections_sum_to_the_whole_with_the_bias_once():
    """FUSED_UP_ROWS: up [E, I, H], down [E, H, I] (down(act(up x))), behind latent projections of the block kept whole
    (made-up names): each rank keeps I/world of both, the width attribute becomes the shard, only rank 0 keeps the
    latent output projection's bias, and the ranks' outputs of latent_out(experts(latent_in(x))) add up exactly."""
    from codegen.policy.runtime.base import FUSED_UP_ROWS

    E_, I_, H_, L_, world = 3, 4, 6, 5, 2
    torch.manual_seed(0)
    names = {"kind": FUSED_UP_ROWS, "gate_up": "", "up": "w_in", "down": "w_out", "size_attr": "width",
             "gate_up_bias": "", "down_bias": "", "latent_in": "squeeze", "latent_out": "unsqueeze"}
    layout = {"experts": "bank", "fused": names, "shared": [], "per_expert": {"gate": "", "up": "u", "down": "d"}}

    def build():
        torch.manual_seed(1)
        block = nn.Module()
        block.squeeze, block.unsqueeze = nn.Linear(H_, L_), nn.Linear(L_, H_)
        block.bank = nn.Module()
        block.bank.w_in = nn.Parameter(torch.randn(E_, I_, L_))
        block.bank.w_out = nn.Parameter(torch.randn(E_, L_, I_))
        block.bank.width = I_
        return block

    def forward(block, x, e):
        hidden = torch.relu(block.squeeze(x) @ block.bank.w_in[e].T) ** 2
        return block.unsqueeze(hidden @ block.bank.w_out[e].T)

    x = torch.randn(2, H_)
    whole = forward(build(), x, 1)
    total = torch.zeros_like(whole)
    for rank in range(world):
        block = build()
        rt.shard_experts(block, "mixer", rank, world, layout, nn.Linear, type(None))
        assert block.bank.width == I_ // world and block.bank.w_out.shape == (E_, L_, I_ // world)
        assert block.squeeze.weight.shape == (L_, H_) and bool(block.unsqueeze.bias.abs().sum()) == (rank == 0)
        total += forward(block, x, 1)
    torch.testing.assert_close(total, whole)
    with pytest.raises(rt.PolicyError) as info:  # an expert width the world does not divide
        rt.shard_experts(build(), "mixer", 0, 3, layout, nn.Linear, type(None))
    assert "cannot split the expert size 4 over 3 ranks" in _one_line(info)


# ------------------------------------------------------------------------------------ compiled ranks (compiled.py)


def _named(module: str, name: str):
    """A stand-in for an op of another library, named as a captured graph names it (`module.name`)."""
    def op(*args):
        return args[0]
    op.__module__, op.__qualname__ = module, name
    return op


def test_compiled_ranks_swap_every_reduction_for_the_ordered_functional_op():
    rt.register_ops()
    deepspeed_reduce = _named("deepspeed", "inference_all_reduce_")
    fallback = _named("transformers", "grouped_mm_fallback")
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    a = graph.call_function(torch.matmul, (x, w))
    graph.call_function(deepspeed_reduce, (a,))  # in place, its result unused: as DeepSpeed's layers issue it
    b = graph.call_function(torch.add, (a, 1.0))
    graph.call_function(deepspeed_reduce, (b,))
    c = graph.call_function(fallback, (b, w, x))
    graph.output(c)
    assert rt.swap_ops(graph) == {"all_reduce": 2, "grouped_mm": 1, "take_rows": 0, "linear_rows": 0, "matmul_folded": 0}
    graph.lint()
    reductions = [n for n in graph.nodes if n.target is torch.ops.codegen.tp_all_reduce.default]
    # each after the one before it (it reads the tensor that one reduced): inductor cannot reorder them, so every
    # rank issues them in one order
    assert [r.args[1] for r in reductions] == [None, a]
    # in place, as the eager op: what reads `a` and `b` later reads their sums, and nothing copies them
    assert [r.args[0] for r in reductions] == [a, b]
    assert not [n for n in graph.nodes if n.op == "call_method"]
    assert c.target is torch.ops.codegen.grouped_mm.default
    assert rt.graph_collectives(graph) == (2, 0)
    assert not any(n.target in (deepspeed_reduce, fallback) for n in graph.nodes)


def test_compiled_ranks_gather_whole_rows_with_index_select():
    """`x[index]` with a 1-D integer index becomes `codegen::take_rows` (inductor fused the experts' unsort with
    their sum into a loop gathering element by element); a mask, a 2-D index or a slice stays as it is."""
    import operator

    rt.register_ops()
    rows, index, mask, pairs = torch.randn(6, 4), torch.tensor([5, 0, 3]), torch.rand(6) > 0.5, torch.zeros(2, 2,
                                                                                                           dtype=int)
    graph = torch.fx.Graph()
    nodes = {}
    for name, value in (("rows", rows), ("index", index), ("mask", mask), ("pairs", pairs)):
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["example_value"] = value
    gathered = graph.call_function(operator.getitem, (nodes["rows"], nodes["index"]))
    masked = graph.call_function(operator.getitem, (nodes["rows"], nodes["mask"]))
    paired = graph.call_function(operator.getitem, (nodes["rows"], nodes["pairs"]))
    sliced = graph.call_function(operator.getitem, (nodes["rows"], slice(0, 2)))
    graph.output((gathered, masked, paired, sliced))
    assert rt.swap_ops(graph) == {"all_reduce": 0, "grouped_mm": 0, "take_rows": 1, "linear_rows": 0, "matmul_folded": 0}
    assert gathered.target is torch.ops.codegen.take_rows.default
    assert all(n.target is operator.getitem for n in (masked, paired, sliced))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    got = module(rows, index, mask, pairs)
    assert torch.equal(got[0], rows[index]) and torch.equal(got[1], rows[mask])


def test_compiled_ranks_run_torchs_cpu_grouped_matmul_on_the_experts_kernel():
    """transformers' bfloat16 grouped matmul calls `torch._grouped_mm`, whose CPU kernel runs a matmul per expert,
    empty ones included: on CPU it becomes `codegen::grouped_mm`; with another output dtype it stays."""
    rt.register_ops()
    torch.manual_seed(0)
    rows = torch.randn(6, 16, dtype=torch.bfloat16)
    weight = torch.randn(4, 16, 32, dtype=torch.bfloat16)
    ends = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    graph = torch.fx.Graph()
    nodes = {}
    for name, value in (("rows", rows), ("weight", weight), ("ends", ends)):
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["example_value"] = value
    grouped = graph.call_function(torch._grouped_mm, (nodes["rows"], nodes["weight"]),
                                  {"offs": nodes["ends"], "bias": None, "out_dtype": None})
    to_float = graph.call_function(torch._grouped_mm, (nodes["rows"], nodes["weight"]),
                                   {"offs": nodes["ends"], "out_dtype": torch.float32})
    output = graph.output((grouped, to_float))
    assert rt.swap_ops(graph) == {"all_reduce": 0, "grouped_mm": 1, "take_rows": 0, "linear_rows": 0, "matmul_folded": 0}
    graph.lint()
    assert grouped.target is torch.ops.codegen.grouped_mm.default and grouped.kwargs == {"offs": nodes["ends"]}
    assert to_float.target is torch._grouped_mm
    output.args = ((grouped,),)  # torch's CPU kernel has no other output dtype: only the swapped one is run
    graph.erase_node(to_float)
    got = torch.fx.GraphModule(torch.nn.Module(), graph)(rows, weight, ends)[0]
    want = torch._grouped_mm(rows, weight, offs=ends)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=2 ** -7)


def test_compiled_ranks_take_strided_rows_contiguous_before_a_matmul_by_a_matrix():
    """DeepSpeed's LM-head shard `x[..., shard] @ W.T`: its rows cannot be viewed as one matrix, so torch's matmul
    batches 1-row products, which inductor's CPU lowering runs as a loop reading W once per row. The rows are taken
    contiguous first; rows that are already contiguous are left as they are (bfloat16 here: a float32 product goes to
    the dense kernel, which reads strided rows as they are)."""
    import operator

    rt.register_ops()
    hidden, weight, batched = (torch.randn(3, 1, 8, dtype=torch.bfloat16), torch.randn(5, 4, dtype=torch.bfloat16),
                               torch.randn(3, 2, 4, dtype=torch.bfloat16))
    graph = torch.fx.Graph()
    nodes = {}
    for name, value in (("hidden", hidden), ("weight", weight), ("batched", batched)):
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["example_value"] = value
    shard = graph.call_function(operator.getitem, (nodes["hidden"], (slice(None), slice(None), slice(4, 8))))
    shard.meta["example_value"] = hidden[:, :, 4:8]
    transposed = graph.call_method("t", (nodes["weight"],))
    transposed.meta["example_value"] = weight.t()
    head = graph.call_function(torch.matmul, (shard, transposed))
    whole = graph.call_function(operator.matmul, (shard, transposed))
    dense = graph.call_function(torch.matmul, (nodes["batched"], transposed))  # contiguous rows: one matrix already
    graph.output((head, whole, dense))
    assert rt.swap_ops(graph) == {"all_reduce": 0, "grouped_mm": 0, "take_rows": 0, "linear_rows": 0, "matmul_folded": 2}
    graph.lint()
    for node in (head, whole):
        assert node.args[0].op == "call_method" and node.args[0].target == "contiguous"
        assert node.args[0].args == (shard,)
    assert dense.args == (nodes["batched"], transposed)
    got = torch.fx.GraphModule(torch.nn.Module(), graph)(hidden, weight, batched)
    assert torch.equal(got[0], hidden[:, :, 4:8] @ weight.t()) and torch.equal(got[1], got[0])


def test_the_compiled_reduction_is_never_dead_code():
    from torch._library.utils import is_impure

    rt.register_ops()
    assert is_impure(torch.ops.codegen.tp_all_reduce.default)  # a rank that needs no result still owes its side


def test_the_compiled_grouped_matmul_is_torchs_product_per_expert_with_a_fake_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    rt.register_ops()
    torch.manual_seed(0)
    experts, width, out = 4, 16, 8
    rows = torch.randn(10, width)
    weight = torch.randn(experts, width, out)
    ends = torch.tensor([3, 3, 7, 10])
    got = torch.ops.codegen.grouped_mm(rows, weight, ends)
    starts = [0, 3, 3, 7]
    want = torch.cat([rows[s:e] @ weight[i] for i, (s, e) in enumerate(zip(starts, ends.tolist()))])
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got, torch._grouped_mm(rows, weight, offs=ends.to(torch.int32)), atol=1e-5)  # eager's
    with FakeTensorMode() as mode:
        fake = torch.ops.codegen.grouped_mm(mode.from_tensor(rows), mode.from_tensor(weight), mode.from_tensor(ends))
    assert tuple(fake.shape) == (10, out)


#: the kernel's builds its tests run: this CPU's own and, on an x86 CPU with AVX-512, the one without it (8-float
#: vectors and the tiles for 16 registers, as on AVX2 and Arm), so that both vector widths' loops are checked on the
#: machine CI has
KERNEL_BUILDS = ["native"] + (["without-avx512"] if "avx512f" in rt._cpu_flags().split() else [])


@pytest.fixture(params=KERNEL_BUILDS)
def kernel_build(request, monkeypatch):
    """The runtime's kernel for the test: this CPU's own, or the build without AVX-512 in its place."""
    if request.param == "without-avx512":
        build = rt.grouped_mm_kernel(("-mno-avx512f",))
        assert build is not None, "the kernel without AVX-512 did not build on this machine"
        monkeypatch.setattr(rt, "grouped_mm_kernel", lambda extra_flags=(): build)
    return request.param


def _grouped_reference(rows, weight, ends):
    """torch's matmul per expert, rows past the last group 0."""
    out, start = rows.new_zeros(rows.shape[0], weight.shape[-1]), 0
    for expert, end in enumerate(ends.tolist()):
        out[start:end] = rows[start:end] @ weight[expert]
        start = end
    return out


@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_kernel_is_torchs_matmul_per_expert(layout, offs_dtype, threads, dtype, kernel_build):
    """float32 groups of any rows go to the C kernel (the dense loop for (E, out, in) weights, past 64 rows in chunks
    of at most 64; for row-major ones the streamed loop up to 4 rows, the blocked loop in place from 5), bfloat16
    groups of 1..16 rows (larger ones, a prefill's, to torch); empty experts are skipped and the padding rows past
    the last group are 0, in both weight layouts transformers passes (gpt-oss's row-major experts, and the transposed
    view of the (E, out, in) ones), float32 and bfloat16 (summed in float32 and rounded once, as torch's bfloat16
    matmul does: within one bfloat16 step of the float32 product)."""
    assert rt.grouped_mm_kernel() is not None, "the kernel did not build on this machine"
    torch.manual_seed(0)
    # 300 columns: more than one column block of the kernel; 270 inputs: more than one block of the blocked loop's
    # 256, and not a multiple of the 8 weight rows (or the vector widths) the kernel takes at a time, so tails run too
    experts, width, out = 9, 270, 300
    counts = torch.tensor([1, 0, 16, 17, 4, 5, 12, 40, 65])  # 1-4, 5-8, 9-16, 17-64 and 65 take different loops
    ends = counts.cumsum(0).to(offs_dtype)
    rows = torch.randn(int(counts.sum()) + 2, width)  # 2 padding rows
    if layout == "rows":
        weight = torch.randn(experts, width, out)
    else:
        weight = torch.randn(experts, out, width).transpose(1, 2)
    rows, weight = rows.to(dtype), weight.to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = rt.experts_grouped_mm(rows, weight, ends)
        # one expert alone (a prefill's): its columns split among the threads a share of whole panels each
        alone_ends = torch.tensor([65], dtype=offs_dtype)
        alone = rt.experts_grouped_mm(rows[:65], weight[:1], alone_ends)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == dtype
    alone_want = _grouped_reference(rows[:65].float(), weight[:1].float(), alone_ends)
    assert torch.allclose(alone.float(), alone_want, atol=1e-4 if dtype == torch.float32 else 1e-1, rtol=2 ** -8)
    want = _grouped_reference(rows.float(), weight.float(), ends)
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()
    else:
        assert torch.equal(got, want.to(dtype)) or torch.allclose(got.float(), want, atol=1e-3, rtol=2 ** -8)
    assert torch.equal(got[-2:], torch.zeros(2, out, dtype=dtype))



@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 12, 16, 17, 33, 64, 65, 130])
def test_the_dense_kernel_is_torchs_linear(rows, threads, kernel_build):
    """An nn.Linear weight's rows run in the C kernel's dense loop (up to 8 rows the 4 x 6 tile, 9-16 the rows as one
    vector's lanes, 17-64 as 2-4 vectors' lanes, more in chunks of 17-64: 65 as 48 and 17, 130 as 48, 48 and 34), with
    and without a bias, on rows strided as DeepSpeed's LM-head shard takes them and on a weight that is a slice of a
    wider one, and by a narrower weight (below `DENSE_KERNEL_WIDE_WEIGHT` elements, fewer than `ONEDNN_ROWS` rows
    are the kernel's too); other dtypes and a bias torch broadcasts are torch's own product, exactly. Where the
    kernel's vectors are 8 floats, `NARROW_DENSE_ROWS` rows and more are torch's product, exactly."""
    kernel = rt.grouped_mm_kernel()
    assert kernel is not None, "the kernel did not build on this machine"
    assert kernel.lanes in (8, 16)
    assert kernel.dense_rows_below == (rt.NARROW_DENSE_ROWS if kernel.lanes == 8 else sys.maxsize)
    torch.manual_seed(0)
    # 300 inputs: a chunk of 256 and a tail that is not a multiple of the 16 lanes; 3500 outputs: blocks of 6 and a
    # tail of 2, panels of 8 and a tail of 4, wide panels of 12, 8 and 6 with tails, and 16-column blocks and a tail
    outputs = 3500
    assert outputs * 300 >= rt.DENSE_KERNEL_WIDE_WEIGHT
    wide = torch.randn(outputs, 310)
    weight, bias = wide[:, :300], torch.randn(outputs)
    hidden = torch.randn(rows, 1, 320)
    shard = hidden[..., 10:310]  # rows 320 floats apart, as x[..., shard] is
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = [rt.linear_rows(shard, weight, b) for b in (None, bias)]
        half = rt.linear_rows(shard.bfloat16(), weight.bfloat16())
        broadcast = rt.linear_rows(shard, weight, bias[:1])  # a bias torch broadcasts: torch's own product
        narrow = rt.linear_rows(shard, weight[:45], bias[:45])
        # torch's own products, at the same thread count (BLAS's sums depend on it)
        wants = [torch.nn.functional.linear(shard, weight, b) for b in (None, bias)]
        half_want = torch.nn.functional.linear(shard.bfloat16(), weight.bfloat16())
        broadcast_want = torch.nn.functional.linear(shard, weight, bias[:1])
        narrow_want = torch.nn.functional.linear(shard, weight[:45], bias[:45])
        torch.set_num_threads(1)
        alone = rt.linear_rows(shard, weight, bias)
    finally:
        torch.set_num_threads(before)
    if rows >= kernel.dense_rows_below:  # torch's own product, at the same thread count
        assert all(torch.equal(result, want) for result, want in zip(got, wants))
        assert torch.equal(narrow, narrow_want)
    else:
        assert torch.equal(got[1], alone)  # each output summed in one order, whatever the thread count
    for result, want in zip(got, wants):
        assert result.shape == (rows, 1, outputs)
        assert torch.allclose(result, want, atol=1e-4, rtol=1e-5), (result - want).abs().max()
    assert torch.equal(half, half_want)
    assert torch.equal(broadcast, broadcast_want)
    assert rows < rt.ONEDNN_ROWS
    assert torch.allclose(narrow, narrow_want, atol=1e-4, rtol=1e-5)


def _kernels_dense_loop(rows, weight, bias):
    """The C kernel's dense loop called directly, on `rows` made contiguous: (rows, out)."""
    x = rows.reshape(-1, rows.shape[-1]).contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    status = rt.grouped_mm_kernel().linear(x.data_ptr(), x.shape[0], x.stride(0), weight.data_ptr(), weight.stride(0),
                                           x.shape[1], weight.shape[0], None if bias is None else bias.data_ptr(),
                                           out.data_ptr(), weight.shape[0], torch.get_num_threads())
    assert status == 0
    return out


@pytest.mark.parametrize("onednn_outruns_torch", [True, False], ids=["avx512", "avx2"])
def test_a_long_prompts_rows_by_a_small_weight_are_onednns_where_it_wins(kernel_build, onednn_outruns_torch,
                                                                          monkeypatch):
    """`ONEDNN_ROWS` or more float32 rows by a weight below `DENSE_KERNEL_WIDE_WEIGHT` elements are oneDNN's linear op,
    exactly, with and without a bias and on strided rows (within float32 sums of torch's own product), where oneDNN
    outruns torch (AVX-512; torch's own product elsewhere); fewer are the kernel's dense loop's, exactly (torch's from
    `NARROW_DENSE_ROWS` where its vectors are 8 floats); with autograd on, by a strided weight or in bfloat16 they
    are torch's own product, exactly."""
    assert rt.ONEDNN_LINEAR, "this torch has no oneDNN linear op"
    monkeypatch.setattr(rt, "ONEDNN_OUTRUNS_TORCH", onednn_outruns_torch)
    torch.manual_seed(0)
    weight, bias = torch.randn(384, 256), torch.randn(384)
    assert weight.numel() < rt.DENSE_KERNEL_WIDE_WEIGHT
    hidden = torch.randn(2, rt.ONEDNN_ROWS // 2 + 3, 264)
    rows = hidden[..., 4:260]  # strided, as x[..., shard] is
    onednn = torch.ops.mkldnn._linear_pointwise
    with torch.no_grad():
        for b in (None, bias):
            got = rt.linear_rows(rows, weight, b)
            assert got.shape == (2, rt.ONEDNN_ROWS // 2 + 3, 384)
            long_product = onednn(rows.contiguous(), weight, b, "none", [], "") if onednn_outruns_torch else \
                torch.nn.functional.linear(rows, weight, b)
            assert torch.equal(got, long_product)
            want = torch.nn.functional.linear(rows, weight, b)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()
        strided_weight = torch.randn(384, 300)[:, :256]
        assert torch.equal(rt.linear_rows(rows, strided_weight), torch.nn.functional.linear(rows, strided_weight))
        half = rows.bfloat16(), weight.bfloat16()
        assert torch.equal(rt.linear_rows(*half), torch.nn.functional.linear(*half))
        few = rows[:, :rt.ONEDNN_ROWS // 4]  # 256 rows: the kernel's dense loop, in chunks (torch's, narrower vectors)
        got = rt.linear_rows(few, weight, bias)
        if 256 < rt.grouped_mm_kernel().dense_rows_below:
            assert torch.equal(got.reshape(-1, 384), _kernels_dense_loop(few, weight, bias))
        else:
            assert torch.equal(got, torch.nn.functional.linear(few, weight, bias))
        want = torch.nn.functional.linear(few, weight, bias)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()
    with torch.enable_grad():
        assert torch.equal(rt.linear_rows(rows, weight, bias), torch.nn.functional.linear(rows, weight, bias))


def test_compiled_ranks_run_float32_dense_products_on_the_dense_kernel():
    """`F.linear(x, w, b)` and DeepSpeed's `x @ w.transpose(-1, -2)` in float32 on CPU become `codegen::linear_rows`
    (with `w` taken back to (out, in)); a bfloat16 product and a product by a matrix whose rows are contiguous stay
    as they are, and the graph computes what it did."""
    rt.register_ops()
    torch.manual_seed(0)
    rows, weight, bias = torch.randn(4, 1, 32), torch.randn(24, 32), torch.randn(24)
    matrix, half = torch.randn(32, 24), torch.randn(24, 32, dtype=torch.bfloat16)
    graph = torch.fx.Graph()
    nodes = {}
    for name, value in (("rows", rows), ("weight", weight), ("bias", bias), ("matrix", matrix), ("half", half)):
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["example_value"] = value
    linear = graph.call_function(torch._C._nn.linear, (nodes["rows"], nodes["weight"], nodes["bias"]))
    transposed = graph.call_method("transpose", (nodes["weight"], -1, -2))
    transposed.meta["example_value"] = weight.transpose(-1, -2)
    sharded = graph.call_function(torch.matmul, (nodes["rows"], transposed))
    plain = graph.call_function(torch.matmul, (nodes["rows"], nodes["matrix"]))
    bf16_rows = graph.call_method("bfloat16", (nodes["rows"],))
    bf16_rows.meta["example_value"] = rows.bfloat16()
    bf16 = graph.call_function(torch._C._nn.linear, (bf16_rows, nodes["half"]))
    graph.output((linear, sharded, plain, bf16))
    assert rt.swap_ops(graph) == {"all_reduce": 0, "grouped_mm": 0, "take_rows": 0, "linear_rows": 2,
                                  "matmul_folded": 0}
    graph.lint()
    assert linear.target is sharded.target is torch.ops.codegen.linear_rows.default
    assert linear.args == (nodes["rows"], nodes["weight"], nodes["bias"])
    assert sharded.args[0] is nodes["rows"] and sharded.args[1].target == "t" and sharded.args[2] is None
    assert plain.target is torch.matmul and bf16.target is torch._C._nn.linear
    got = torch.fx.GraphModule(torch.nn.Module(), graph)(rows, weight, bias, matrix, half)
    want = (torch.nn.functional.linear(rows, weight, bias), rows @ weight.t())
    for result, expected in zip(got, want):
        assert torch.allclose(result, expected, atol=1e-5, rtol=1e-5)

def _fused_experts_module(family: str):
    """transformers' own experts module of `family`'s tiny example (5.x), its weights drawn, or None (4.x)."""
    from codegen.harness.examples import example_config, installed_families, model_class

    if family not in installed_families() or not _experts_implementations():
        return None
    torch.manual_seed(0)
    model = model_class(family).from_config(example_config(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_fused_experts_are_transformers_grouped_experts(family, threads, kernel_build):
    """`codegen::fused_experts` on transformers' own experts module equals its `grouped_mm` forward: Qwen3-MoE's
    (SiLU gate, gate and up concatenated, (E, out, in) weights, also taken row-major) and GPT-OSS's (clamped SwiGLU,
    interleaved, row-major, biases); experts with no row, 1 row, 4, 16 and more than 16 (together or alone, by the
    layout), in both layouts."""
    model = _fused_experts_module(family)
    if model is None:
        return  # 4.x: experts are per-expert MLPs, which the op does not take
    assert rt.fused_experts_available(), "the fused experts cannot run on this machine"
    layout = FAMILIES[family].policy_layout()
    experts = next(m for m in model.modules() if hasattr(m, "is_concatenated"))
    call = rt.fused_call(experts, layout["fused"])
    assert call is not None
    count = getattr(experts, "num_experts", None) or model.config.num_local_experts
    tokens = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    index = torch.zeros(40, 2, dtype=torch.int64)  # experts 0..3 and the last: 20, 4, 39, 1 and 16 rows, others none
    index[20:36, 0], index[36:, 0], index[:39, 1], index[39, 1] = count - 1, 1, 2, 3
    weights = torch.rand(40, 2, generator=torch.Generator().manual_seed(3))
    counts = torch.bincount(index.flatten(), minlength=count).tolist()
    assert counts[:4] == [20, 4, 39, 1] and counts[-1] == 16 and 0 in counts
    model.config._experts_implementation = "grouped_mm"
    gate_up, down = getattr(experts, call[0]), getattr(experts, call[1])
    if not experts.is_transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    biases = [getattr(experts, name) if name else None for name in call[2:4]]
    assert (biases[0] is not None) == (family == "gpt_oss")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            want = experts(tokens, index, weights)
            got = [rt.fused_experts(tokens, index, weights, g, d, *biases, *call[4:])
                   for g, d in ((gate_up, down), (gate_up.contiguous(), down.contiguous()),
                                (gate_up.transpose(1, 2).contiguous().transpose(1, 2),
                                 down.transpose(1, 2).contiguous().transpose(1, 2)))]
    finally:
        torch.set_num_threads(before)
    scale = want.abs().max().item()
    for one in got:
        assert one.shape == want.shape and (one - want).abs().max().item() <= 1e-5 * scale


def test_the_fused_experts_refuse_an_expert_id_outside_the_experts():
    gate_up, down = torch.randn(3, 8, 4), torch.randn(3, 2, 8)
    with pytest.raises(RuntimeError, match="expert id outside the experts"):
        rt.fused_experts(torch.randn(2, 8), torch.tensor([[0, 3], [1, 2]]), torch.rand(2, 2), gate_up, down)


def _use_fused(model, family):
    layout = FAMILIES[family].policy_layout()
    return rt.use_fused_experts(rt.moe_blocks(model, layout), layout)


def test_the_policy_runs_transformers_experts_as_the_fused_op_where_they_take_it():
    """A float32 CPU model on transformers' default (`grouped_mm`) switches to `codegen`: every experts module runs the
    op and the logits stay (Qwen3-MoE, GPT-OSS; Qwen3-MoE's weights, kept output-dim first, now stored with `out`
    contiguous, the same Parameters; GPT-OSS's so already); experts whose gate is not the layout's (checked on a
    probe) are left to transformers; a model set to another implementation keeps it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    for family in ("qwen3_moe", "gpt_oss"):
        model = _fused_experts_module(family)
        if model is None:
            return
        weights = {name: (param, param.shape) for name, param in model.named_parameters() if param.dim() == 3}
        with torch.no_grad():
            want = model(ids).logits
            assert _use_fused(model, family) is None
            got = model(ids).logits
        assert weights and {name: (p, p.shape) for name, p in model.named_parameters() if p.dim() == 3} == weights
        assert all(param.stride(2 if family == "gpt_oss" else 1) == 1 for param, _shape in weights.values()), family
        assert model.config._experts_implementation == rt.IMPLEMENTATION
        assert rt.fused_module_count(model) == model.config.num_hidden_layers
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), family
    with FakeTensorMode() as mode:
        hidden = mode.from_tensor(torch.randn(5, 8))
        fake = torch.ops.codegen.fused_experts(hidden, mode.from_tensor(torch.zeros(5, 2, dtype=torch.int64)),
                                               mode.from_tensor(torch.rand(5, 2)),
                                               mode.from_tensor(torch.randn(3, 8, 4)),
                                               mode.from_tensor(torch.randn(3, 2, 8)), None, None, rt.GATE_SILU, 0.0,
                                               0.0)
    assert tuple(fake.shape) == (5, 8)

    other_gate = _fused_experts_module("qwen3_moe")
    for module in other_gate.modules():
        if hasattr(module, "is_concatenated"):
            module.act_fn = torch.nn.GELU()
    assert _use_fused(other_gate, "qwen3_moe") is None and rt.fused_module_count(other_gate) == 0
    assert other_gate.config._experts_implementation == rt.REPLACED
    chosen = _fused_experts_module("qwen3_moe")
    chosen.config._experts_implementation = "batched_mm"
    assert _use_fused(chosen, "qwen3_moe") is None and rt.fused_module_count(chosen) == 0
    assert chosen.config._experts_implementation == "batched_mm"



def _tiny_model(family: str, seed: int = 0):
    """`family`'s tiny example (transformers' own classes, 5.x or 4.x), weights drawn, eval mode."""
    from codegen.harness.examples import example_config, model_class

    torch.manual_seed(seed)
    model = model_class(family).from_config(example_config(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _attention_layer(model):
    return next(m for m in model.modules() if hasattr(m, "num_key_value_groups"))


def _eager_attention_case(family):
    """(heads, kv heads, head_dim, compare) of `family`'s first attention layer: `compare(query, key, value, mask)`
    is (the kernels' output, the layer's own eager attention's) for that call."""
    model = _tiny_model(family)
    layer = _attention_layer(model)
    eager, sinks = rt.family_eager(layer), getattr(layer, "sinks", None)
    heads = model.config.num_attention_heads

    def compare(query, key, value, mask):
        with torch.no_grad():
            want = eager(layer, query, key, value, mask, scaling=layer.scaling, dropout=0.0)[0]
            got = rt.eager_attention(query, key, value, mask, None if sinks is None else sinks.detach(),
                                     layer.scaling)
        return got, want

    return heads, heads // layer.num_key_value_groups, layer.head_dim, compare


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_the_decode_attention_kernel_is_the_familys_eager_attention(family, threads, kernel_build):
    """`codegen::eager_attention` for one new token against transformers' own eager attention of the family
    (GPT-OSS: sinks and grouped heads; Qwen3-MoE: no sinks): 1 to 40 cached columns (not a multiple of 16 included),
    keys and values as views of a larger store, masks with min and -inf columns, a mask shared by the batch."""
    heads, kv_heads, dim, compare = _eager_attention_case(family)
    generator = torch.Generator().manual_seed(2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for length in (1, 17, 40):
            query = torch.randn(3, 1, heads, dim, generator=generator).transpose(1, 2)
            store = torch.randn(2, 3, kv_heads, length + 7, dim, generator=generator)
            key, value = store[0, :, :, 3:3 + length], store[1, :, :, 3:3 + length]
            mask = torch.zeros(3, 1, 1, length)
            mask[0, ..., : length // 2] = torch.finfo(torch.float32).min
            mask[1, ..., -1:] = float("-inf") if length > 1 else 0.0
            for rows in (mask, mask[:1]):
                assert rt.kernel_takes(query, key, value, rows)
                got, want = compare(query, key, value, rows)
                assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-4), (family, length)
    finally:
        torch.set_num_threads(before)
    assert not rt.kernel_takes(query.to(torch.bfloat16), key, value, None)
    assert not rt.kernel_takes(torch.randn(3, heads, 1, 24), torch.randn(3, kv_heads, 5, 24),
                               torch.randn(3, kv_heads, 5, 24), None)  # a head_dim the decode kernel does not take


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_the_prefill_attention_kernel_is_the_familys_eager_attention(family, threads, kernel_build):
    """`codegen::eager_attention` for several new tokens against the family's own eager attention: prompts of 2 to
    70 tokens (more than one block of query rows), after 0 or 9 cached columns, causal masks with a sliding window or
    without, left padding (a row every key of which is masked included), a mask shared by the batch, no mask, and
    query, keys and values as strided views."""
    heads, kv_heads, dim, compare = _eager_attention_case(family)
    generator = torch.Generator().manual_seed(3)
    least = torch.finfo(torch.float32).min
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for new, cached, window in ((2, 0, None), (33, 0, None), (70, 9, None), (70, 0, 20), (5, 9, 4)):
            length = cached + new
            query = torch.randn(2, new, heads, dim, generator=generator).transpose(1, 2)
            store = torch.randn(2, 2, kv_heads, length + 4, dim, generator=generator)
            key, value = store[0, :, :, 1:1 + length], store[1, :, :, 1:1 + length]
            column, row = torch.arange(length)[None, :], torch.arange(cached, length)[:, None]
            hidden = (column > row) if window is None else (column > row) | (column <= row - window)
            mask = torch.zeros(2, 1, new, length).masked_fill(hidden, least)
            mask[1, ..., :3] = float("-inf") if window else least
            mask[0, :, 0, :] = least  # a row that masks every key: eager's softmax is then over all of them
            for rows in (mask, mask[:1], None):
                assert rt.kernel_takes(query, key, value, rows)
                got, want = compare(query, key, value, rows)
                assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-4), \
                    (family, new, cached, window)
        # rows not a row's width apart (an expanded query, keys and values): taken contiguous for BLAS first
        query, key = query[:, :, :1].expand(query.shape), key[:, :, :1].expand(key.shape)
        got, want = compare(query, key, key, mask)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_the_policy_runs_eager_attention_as_the_kernels_where_the_probe_agrees(monkeypatch):
    """GPT-OSS (eager: its sinks rule out SDPA) and a float32 model on SDPA switch to `codegen_eager`: every
    attention layer adopted, greedy tokens and logits as before; a bfloat16 model on SDPA is left alone; an eager
    attention computing something else (a different scaling) fails the probe and keeps its own, its config
    untouched; a call with a keyword the family's eager function takes beyond the usual ones (a softcap) runs that
    function, and an SDPA layer's call with no mask over several rows (causal to SDPA) runs SDPA."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4))

    def greedy(model):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                                 do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    for family, implementation in (("gpt_oss", "eager"), ("qwen3_moe", "sdpa")):
        model = _tiny_model(family)
        model.config._attn_implementation = implementation
        want_tokens, want_logits = greedy(model)
        assert rt.use_eager_attention_kernel(model) is None
        assert model.config._attn_implementation == rt.ATTENTION_IMPLEMENTATION
        assert rt.attention_kernel_layer_count(model) == model.config.num_hidden_layers
        got_tokens, got_logits = greedy(model)
        assert torch.equal(got_tokens, want_tokens)
        assert (got_logits - want_logits).abs().max().item() <= 1e-5 * want_logits.abs().max().item()

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _attention_layer(model)  # the SDPA model's, adopted: no mask over several rows is causal there, as before
    query, key, value, _ = list(rt._probe_calls(model.config.num_attention_heads, layer.num_key_value_groups,
                                                layer.head_dim, torch.Generator()))[1]
    with torch.no_grad():
        got = rt.codegen_eager_attention(layer, query, key, value, None, scaling=layer.scaling)[0]
        assert torch.allclose(got, sdpa_attention_forward(layer, query, key, value, None, scaling=layer.scaling)[0],
                              atol=1e-5)
        assert not torch.allclose(got, rt.eager_attention(query, key, value, None, None, layer.scaling), atol=1e-3)

    half = _tiny_model("qwen3_moe").to(torch.bfloat16)
    half.config._attn_implementation = "sdpa"
    assert rt.use_eager_attention_kernel(half) is None and rt.attention_kernel_layer_count(half) == 0
    assert half.config._attn_implementation == "sdpa"

    capped = _tiny_model("gpt_oss")
    module = sys.modules[type(_attention_layer(capped)).__module__]
    own = module.eager_attention_forward

    def halved(layer, query, key, value, mask, scaling, dropout=0.0, **kwargs):
        return own(layer, query, key, value, mask, scaling * 0.5, dropout=dropout, **kwargs)

    monkeypatch.setattr(module, "eager_attention_forward", halved)
    assert rt.use_eager_attention_kernel(capped) is None and rt.attention_kernel_layer_count(capped) == 0
    assert capped.config._attn_implementation == "eager"

    def softcapped(layer, query, key, value, mask, scaling, dropout=0.0, softcap=None, **kwargs):
        return own(layer, query, key, value, mask, scaling * (0.5 if softcap else 1.0), dropout=dropout, **kwargs)

    monkeypatch.setattr(module, "eager_attention_forward", softcapped)
    assert rt.use_eager_attention_kernel(capped) is None and rt.attention_kernel_layer_count(capped) > 0
    layer = _attention_layer(capped)
    query, key, value, mask = next(rt._probe_calls(capped.config.num_attention_heads, layer.num_key_value_groups,
                                                   layer.head_dim, torch.Generator()))
    with torch.no_grad():
        plain, capped_out = (rt.codegen_eager_attention(layer, query, key, value, mask, scaling=0.25, **kw)[0]
                             for kw in ({}, {"softcap": 30.0}))
        assert torch.allclose(plain, own(layer, query, key, value, mask, 0.25)[0], atol=1e-5)
        assert torch.allclose(capped_out, own(layer, query, key, value, mask, 0.125)[0], atol=1e-5)

    with FakeTensorMode() as mode:
        fake = [torch.ops.codegen.eager_attention(mode.from_tensor(torch.randn(2, 8, rows, 16)),
                                                  mode.from_tensor(torch.randn(2, 2, 5, 16)),
                                                  mode.from_tensor(torch.randn(2, 2, 5, 16)), None, None, 0.25)
                for rows in (1, 3)]
    assert [tuple(f.shape) for f in fake] == [(2, 1, 8, 16), (2, 3, 8, 16)]


def test_offsets_past_the_rows_are_left_to_torch_not_read_by_the_kernel():
    """torch slices as transformers' fallback does (to the rows there are); the kernel never reads past them."""
    rows, weight, ends = torch.randn(4, 8), torch.randn(2, 8, 4), torch.tensor([2, 9])
    assert torch.equal(rt.experts_grouped_mm(rows, weight, ends), _grouped_reference(rows, weight, ends))


def test_without_a_compiler_the_experts_run_torchs_matmul_and_say_so_once(monkeypatch, capsys):
    fresh = runtime_module("codegen_test_no_compiler")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    rows, weight, ends = torch.randn(5, 8), torch.randn(3, 8, 4), torch.tensor([2, 2, 4])
    for _ in range(2):
        assert torch.equal(fresh.experts_grouped_mm(rows, weight, ends), _grouped_reference(rows, weight, ends))
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "grouped-matmul kernel cannot be built here" in said[0], said


def test_a_policy_loaded_from_a_file_becomes_importable_for_the_compiler(monkeypatch):
    name = "codegen_test_compiled_policy"
    monkeypatch.delitem(sys.modules, name, raising=False)
    namespace = {"__name__": name, "init_inference": lambda: None}
    rt.importable(namespace)
    assert sys.modules[name].init_inference is namespace["init_inference"]
    rt.importable(namespace)  # again: the same module, nothing to do
    with pytest.raises(rt.PolicyError, match="another module is imported as"):
        rt.importable({"__name__": name, "init_inference": lambda: None})


class _Tiny(torch.nn.Module):
    """A forward torch.compile captures whole, or (`branch`) one it must break at a value read back into Python."""

    def __init__(self, branch: bool = False):
        super().__init__()
        self.proj, self.branch = torch.nn.Linear(4, 4), branch

    def forward(self, x):
        y = self.proj(x)
        if self.branch and y.sum().item() > 0:  # data-dependent Python control flow: a graph break
            y = y * 2
        return y


def test_a_compiled_forward_counts_the_graphs_it_runs_as_they_run():
    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(3, 4)
    compiled = rt.CompiledForward(model)
    with torch.no_grad():
        want = model(x)
        assert torch.allclose(compiled(x), want, atol=1e-6) and compiled(x).shape == want.shape
    assert compiled.fallback is None and len(compiled.graphs) == 1
    assert compiled.ran == {"graphs": 2, "all_reduces": 0, "other_collectives": 0}
    compiled.backend.reset_ran()
    assert compiled.ran["graphs"] == 0


def test_each_compiled_model_runs_graphs_of_its_own():
    """The graphs' guards leave the modules' attributes out (their cost per call), so two models whose forward is one
    code object must not share graphs: the second, of other widths, captures and runs its own."""
    torch.manual_seed(0)
    first, second, x = _Tiny(), _Tiny(), torch.randn(3, 4)
    second.proj = torch.nn.Linear(4, 6)
    compiled = [rt.CompiledForward(first), rt.CompiledForward(second)]
    with torch.no_grad():
        for model, forward in zip((first, second), compiled):
            assert torch.allclose(forward(x), model(x), atol=1e-6) and forward(x).shape == model(x).shape
    assert [len(forward.graphs) for forward in compiled] == [1, 1]


def test_a_forward_torch_compile_would_break_runs_eager_with_one_line(capsys):
    torch.manual_seed(0)
    model, x = _Tiny(branch=True), torch.randn(3, 4)
    compiled = rt.CompiledForward(model)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x)) and torch.equal(compiled(x), model(x))
    assert compiled.fallback and compiled.graphs == [] and compiled.ran["graphs"] == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cannot capture the forward as one graph" in lines[0] and "running eager" in lines[0]


def _filled_cache(layers=2, batch=3, heads=2, length=5, width=4):
    """transformers' growing cache after a prefill of `length` columns."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for index in range(layers):
        cache.update(torch.randn(batch, heads, length, width), torch.randn(batch, heads, length, width), index)
    return cache


def test_a_growing_cache_layer_appends_in_place_and_gives_up_its_store_when_its_keys_change(monkeypatch):
    """Each `DynamicLayer` becomes an `AppendingLayer`: keys and values are views of a store's first columns, a step
    writes its columns into the store (its address stays while it has room: no copy of the cache), and the views
    equal what `torch.cat` would give. Outgrowing the store, keys replaced under it (the server's row drops), a crop,
    a reset: the same values, a store allocated afresh."""
    monkeypatch.setattr(rt, "KV_HEADROOM", 2)
    torch.manual_seed(0)
    cache = _filled_cache()
    want = [[layer.keys.clone(), layer.values.clone()] for layer in cache.layers]

    def step(columns=1):
        rt.append_in_place(cache, columns)
        for index, layer in enumerate(cache.layers):
            keys, values = torch.randn(3, 2, columns, 4), torch.randn(3, 2, columns, 4)
            got = cache.update(keys, values, index)
            want[index] = [torch.cat([want[index][0], keys], 2), torch.cat([want[index][1], values], 2)]
            assert all(torch.equal(g, w) for g, w in zip(got, want[index]))
            assert torch.equal(layer.keys, want[index][0]) and torch.equal(layer.values, want[index][1])

    step()
    layer = cache.layers[0]
    assert type(layer).__name__ == "AppendingLayer" and isinstance(layer, type(_filled_cache().layers[0]))
    store = layer.key_store.data_ptr()
    assert layer.key_store.shape[2] == 5 + 1 + 2 and layer.keys.data_ptr() == store
    step()
    assert layer.key_store.data_ptr() == store and cache.get_seq_length() == 7  # in place, one column kept free
    step()
    assert layer.key_store.data_ptr() != store and layer.key_store.shape[2] == 7 + 1 + 2  # outgrown: a new store
    rows = torch.tensor([2, 0])  # as the server drops a row: keys and values replaced under the layer
    for index, layer in enumerate(cache.layers):
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        want[index] = [w.index_select(0, rows) for w in want[index]]
    monkeypatch.setattr(torch, "randn", lambda *shape: torch.rand(2, *shape[1:]))  # the batch is 2 rows now
    step()
    assert cache.layers[0].keys.data_ptr() == cache.layers[0].key_store.data_ptr()
    cache.crop(-2)
    want = [[w[:, :, :-2] for w in pair] for pair in want]
    assert cache.layers[0].key_store is None and cache.get_seq_length() == 7
    step(), step()
    layer = cache.layers[1]
    layer.update(torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4))  # past its room, no room made: as transformers does
    assert layer.key_store is None and layer.get_seq_length() == 11 and layer.keys.shape[2] == 11
    cache.reset()
    plain = _filled_cache(length=9)  # what transformers' own layers of these columns do
    plain.reset()  # transformers 5.x drops the columns, 4.x zeroes them: the same either way
    assert cache.get_seq_length() == plain.get_seq_length() and cache.layers[0].key_store is None


def test_a_sliding_window_layer_appends_in_place_and_keeps_transformers_window(monkeypatch):
    """A `DynamicSlidingWindowLayer` becomes an `AppendingSlidingWindowLayer`: a step writes its columns into the
    store and the window moves up it. Step by step, what attention gets, what the layer keeps, its length and its
    mask sizes equal transformers' own layer's, before the window fills, after, past the store's room and for a
    several-column step."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    monkeypatch.setattr(rt, "KV_HEADROOM", 3)
    torch.manual_seed(0)
    ours, theirs = DynamicSlidingWindowLayer(sliding_window=4), DynamicSlidingWindowLayer(sliding_window=4)
    keys, values = torch.randn(2, 3, 3, 8), torch.randn(2, 3, 3, 8)  # a 3-column prompt
    ours.update(keys, values), theirs.update(keys, values)
    cache = types.SimpleNamespace(layers=[ours])
    mask_sizes_args = inspect.signature(theirs.get_mask_sizes).parameters
    stores = []
    for columns in (1, 1, 1, 1, 2, 1, 1):
        rt.append_in_place(cache, columns)
        keys, values = torch.randn(2, 3, columns, 8), torch.randn(2, 3, columns, 8)
        got, want = ours.update(keys, values), theirs.update(keys, values)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert ours.get_seq_length() == theirs.get_seq_length()
        query = torch.arange(columns) if "cache_position" in mask_sizes_args else columns  # transformers 4.x: positions
        assert ours.get_mask_sizes(query) == theirs.get_mask_sizes(query)
        stores.append(ours.key_store.data_ptr())
    assert type(ours).__name__ == "AppendingSlidingWindowLayer" and isinstance(ours, DynamicSlidingWindowLayer)
    assert ours.start > 0 and ours.keys.data_ptr() != ours.key_store.data_ptr()  # the window moved up the store
    assert stores[0] == stores[1] == stores[2] != stores[3]  # room for 3 more past the first step's, one kept free
    if hasattr(ours, "activate_past_recording"):  # transformers 5.x: a layer keeping its past for a crop
        ours.activate_past_recording(), theirs.activate_past_recording()
        rt.append_in_place(cache, 1)
        keys, values = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
        assert all(torch.equal(g, w) for g, w in zip(ours.update(keys, values), theirs.update(keys, values)))
        assert ours.key_store is None and torch.equal(ours.keys, theirs.keys)


def test_only_cpu_dynamic_layers_with_keys_append_in_place():
    """An empty layer (before its prefill), another kind of layer, an unknown token count: left as they are."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    class OtherLayer(DynamicLayer):
        pass

    empty = DynamicCache()
    rt.append_in_place(empty, 1)
    cache = _filled_cache(layers=1)
    sliding, other = DynamicSlidingWindowLayer(sliding_window=4), OtherLayer()
    for layer in (sliding, other):
        layer.update(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
    cache.layers += [sliding, other]
    rt.append_in_place(cache, None)
    assert type(cache.layers[0]).__name__ == "DynamicLayer"
    rt.append_in_place(cache, 1)
    assert [type(layer).__name__ for layer in cache.layers] == ["AppendingLayer", "AppendingSlidingWindowLayer",
                                                                 "OtherLayer"]
    assert rt.new_columns((torch.ones(2, 3, dtype=torch.long),), {}) == 3
    assert rt.new_columns((), {"inputs_embeds": torch.ones(2, 1, 8)}) == 1 and rt.new_columns((), {}) is None


class _CacheUser(torch.nn.Module):
    """Keys and values of each token written into its cache, and a sum over every column the cache holds."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16)

    def forward(self, input_ids, past_key_values):
        keys, values = self.proj(self.embed(input_ids)).view(*input_ids.shape, 2, 2, 4).permute(2, 0, 3, 1, 4)
        keys, values = past_key_values.update(keys, values, 0)
        return (keys * values).sum(2) + past_key_values.get_seq_length()


@pytest.mark.parametrize("kind", ["growing", "sliding"])
def test_a_compiled_rank_appends_its_cache_in_place_in_one_graph_for_every_length(monkeypatch, kind):
    """Compiled, the cache's store is written in place (its address kept across steps) and one decode graph serves
    every length, the store's re-allocation and a full sliding window's move included; every step equals the eager
    forward on transformers' cache."""
    from transformers import DynamicCache, GptOssConfig, Qwen3MoeConfig

    monkeypatch.setattr(rt, "KV_HEADROOM", 2)
    torch.manual_seed(0)
    model = _CacheUser()
    compiled = rt.CompiledForward(model)
    # a model's cache: its layers there from the start; a window of 5 fills at the second step
    config = (Qwen3MoeConfig(num_hidden_layers=1) if kind == "growing" else
              GptOssConfig(num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=5))
    ours, theirs = DynamicCache(config=config), DynamicCache(config=config)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(compiled(prompt, past_key_values=ours), model(prompt, theirs), atol=1e-5)
        stores = []
        for token in range(6):
            ids = torch.tensor([[token], [9 - token]])
            assert torch.allclose(compiled(ids, past_key_values=ours), model(ids, theirs), atol=1e-5)
            stores.append(ours.layers[0].key_store.data_ptr())
            # a sliding window filling up takes a graph for each side of it (transformers' mask sizes, too)
            captured = len(compiled.graphs) if token <= (0 if kind == "growing" else 1) else captured
    names = {"growing": "AppendingLayer", "sliding": "AppendingSlidingWindowLayer"}
    assert type(ours.layers[0]).__name__ == names[kind] and ours.get_seq_length() == 9
    assert stores[0] == stores[1] != stores[2] == stores[3] != stores[4] == stores[5]  # room for 2 more, one kept free
    assert compiled.fallback is None and len(compiled.graphs) == captured  # the first step's graph serves them all


def test_only_a_cuda_decode_step_on_a_static_cache_runs_as_a_cuda_graph():
    """The CUDA-graph entry takes fixed shapes only: a decode step (one token per row) on a cache updated in place.
    On the CPU, a prefill, or a growing cache: the compiled forward as before."""
    from transformers import DynamicCache, Qwen3MoeConfig, StaticCache

    config = Qwen3MoeConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=4)
    static, dynamic = StaticCache(config=config, max_cache_len=4), DynamicCache(config=config)
    token = torch.ones(1, 1, dtype=torch.long)
    assert rt.static_cache_step((), {"input_ids": token, "cache": static}) is False  # on the CPU
    assert rt.static_cache_step((token,), {"past_key_values": dynamic}) is False
    assert rt.static_cache_step((torch.ones(1, 3, dtype=torch.long),), {"cache": static}) is False
    assert rt.step_cache({"past_key_values": dynamic}) is dynamic and rt.step_cache({"cache": static}) is static


def test_a_static_cache_filled_inside_a_compiled_prefill_gets_fixed_addresses():
    """transformers marks a static cache's tensors for CUDA graphs as it allocates them, except while compiling (a
    compiled rank's prefill): the compiled forward marks what is left unmarked before a CUDA-graph step."""
    from transformers import Qwen3MoeConfig, StaticCache

    config = Qwen3MoeConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=4)
    cache = StaticCache(config=config, max_cache_len=4)
    cache.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), layer_idx=0)  # layer 1 stays uninitialized
    layer = cache.layers[0]
    # transformers 5.x keeps the layer's length in a tensor too; 4.x has no such tensor
    fixed = [t for t in (layer.keys, layer.values, getattr(layer, "cumulative_length", None)) if t is not None]
    for tensor in fixed:
        del tensor._dynamo_static_input_type  # as a compiled region leaves them
    rt.mark_static_cache(cache)
    assert [t._dynamo_static_input_type for t in fixed] == ["unguarded"] * len(fixed)
    assert not cache.layers[1].is_initialized


def test_a_cuda_graphs_outputs_are_handed_over_as_copies_and_transformers_own_compile_stays_off():
    """A CUDA graph's next replay overwrites its outputs: the caller gets copies (the cache object as it is). And a
    compiled model's `generate` must not compile `__call__` again around the policy's graphs."""
    from transformers import GenerationConfig

    logits, cache = torch.randn(2, 3), object()
    out = rt._own_outputs({"logits": logits, "cache": cache})
    assert torch.equal(out["logits"], logits) and out["logits"].data_ptr() != logits.data_ptr()
    assert out["cache"] is cache
    model = _Tiny()
    model.generation_config = GenerationConfig()
    rt.compile_forward(model)
    assert model.generation_config.disable_compile is True


# ----------------------------------------------------------------------- CUDA ranks' attention (cuda_attention.py)
@pytest.fixture
def attention_switches():
    """torch's process-wide attention switches, restored after the test."""
    cuda = torch.backends.cuda
    saved = (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled())
    yield cuda
    cuda.enable_flash_sdp(saved[0]), cuda.enable_mem_efficient_sdp(saved[1]), cuda.enable_cudnn_sdp(saved[2])


def test_a_cuda_rank_turns_cudnn_attention_off_and_a_cpu_rank_leaves_it(attention_switches):
    cuda = attention_switches
    cuda.enable_flash_sdp(True), cuda.enable_mem_efficient_sdp(True), cuda.enable_cudnn_sdp(True)
    assert rt.cudnn_attention_off(torch.device("cpu")) is None and cuda.cudnn_sdp_enabled()
    note = rt.cudnn_attention_off(torch.device("cuda", 0))
    assert "cuDNN's attention turned off" in note and not cuda.cudnn_sdp_enabled()
    assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled()  # only cuDNN's switch changes
    assert rt.cudnn_attention_off(torch.device("cuda", 0)) is None  # already off: nothing to say


def test_a_users_choice_of_cudnn_attention_alone_stands(attention_switches):
    cuda = attention_switches
    cuda.enable_flash_sdp(False), cuda.enable_mem_efficient_sdp(False), cuda.enable_cudnn_sdp(True)
    assert rt.cudnn_attention_off(torch.device("cuda", 0)) is None and cuda.cudnn_sdp_enabled()
