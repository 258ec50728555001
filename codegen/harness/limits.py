"""How close a setup runs to the machine's limit: the floor of a forward, from the bytes a rank must read and the
FLOPs it must do, against the memory bandwidth and GEMM throughput measured on the same ranks in the same run.

A rank's work for one forward comes from what it holds (its inventory, codegen.harness.worker.limits.inventory: the
parameter tensors on that rank, walked, not a family formula) and what the routing hit in that forward:

- every parameter outside the routed experts is read once per forward; a lookup table (an embedding) only in the
  rows the tokens look up; the output head in full;
- of each MoE layer's routed experts, each expert the routing hit is read once (distinct experts hit);
- FLOPs: 2 per weight element per token of every matrix outside the experts, 2 per element of the head per
  position whose logits are computed, and 2 per element of one expert per (token, expert) pair routed to it.

Left out, so the floor stays a lower bound: KV-cache and activation traffic, attention's score products, the
element-wise ops. Floor time = max(bytes / bandwidth, FLOPs / GEMM throughput); the slowest rank's floor is the
step's, as the measured time is the slowest rank's. Standard library only: the report reads it too.
"""

from __future__ import annotations

import statistics

#: what `machine_limits` says about how the limits were measured (the record's `machine_limits.method`)
METHOD = {
    "bandwidth": "STREAM-like: the sum of a float32 buffer several times the last-level cache (read), and a copy of "
                 "one half onto the other (bytes read + written); best of the trials, every rank of the launch "
                 "measuring at once after a barrier (the per-rank figure is its share of the shared bandwidth), at "
                 "the rank's thread count",
    "gemm": "n x n x n matmul in the run's dtype on each rank at once (2 n^3 FLOPs), best of the trials",
    "floor": "max(bytes read / read bandwidth, FLOPs / GEMM throughput) per rank, the slowest rank's; bytes: every "
             "parameter the rank holds outside the routed experts (lookup tables: the rows looked up), plus each "
             "routed expert the routing hit in that forward once; FLOPs: 2 per matrix element per token (head: per "
             "position whose logits are computed; experts: per (token, expert) pair routed); KV cache, activations "
             "and attention scores left out (a lower bound)",
}


def forward_work(inventory: dict, hits: list[dict] | None, tokens: int, logit_positions: int) -> dict:
    """{"bytes", "flops"} one rank must read and do for one forward of `tokens` tokens.

    `hits`: per MoE layer (the inventory's `moe` order) {"distinct": experts hit, "assignments": (token, expert)
    pairs}; None where the routing was not seen: then every expert is counted read (bytes) and no expert FLOPs.
    """
    nbytes = inventory["dense_bytes"] + inventory["head_bytes"]
    nbytes += min(inventory["lookup_bytes"], tokens * inventory["lookup_row_bytes"])
    flops = tokens * inventory["dense_flops_per_token"] + logit_positions * inventory["head_flops_per_token"]
    for k, layer in enumerate(inventory["moe"]):
        experts = max(layer["experts"], 1)
        hit = hits[k] if hits is not None and k < len(hits) else None
        distinct = experts if hit is None else min(hit["distinct"], experts)
        nbytes += layer["expert_bytes"] * distinct // experts
        if hit is not None:
            flops += 2 * hit["assignments"] * layer["expert_numel"] // experts
    return {"bytes": int(nbytes), "flops": int(flops)}


def floor_seconds(work: dict, limits: dict) -> float | None:
    """max(bytes / read bandwidth, FLOPs / GEMM throughput) for one rank; None without limits."""
    bandwidth, gemm = limits.get("read_bytes_per_s"), limits.get("gemm_flops_per_s")
    if not bandwidth or not gemm:
        return None
    return max(work["bytes"] / bandwidth, work["flops"] / gemm)


def _bound(work: dict, limits: dict) -> str:
    return "memory" if work["bytes"] / limits["read_bytes_per_s"] >= work["flops"] / limits["gemm_flops_per_s"] \
        else "compute"


def phase_floor(works: list[dict], limits: list[dict]) -> dict | None:
    """One phase's floor over the ranks (works[k] on rank k, measured at limits[k]): the slowest rank's."""
    per_rank = [(floor_seconds(w, lim), w, lim) for w, lim in zip(works, limits)]
    if not per_rank or any(s is None for s, _, _ in per_rank):
        return None
    seconds, work, lim = max(per_rank, key=lambda x: x[0])
    return {"s": seconds, "bytes_per_rank": work["bytes"], "flops_per_rank": work["flops"], "bound": _bound(work, lim)}


def setup_floor(per_rank_work: list[dict], per_rank_limits: list[dict], e2e_tokens: int = 0) -> dict | None:
    """A setup's floors: `prefill` (the bench's, every position's logits), `decode` (the median over the counted
    decode steps of their floors), `ttft` (generate's prefill: the last position's logits) and `e2e`
    (ttft + (N - 1) decode steps), each {"s", "bytes_per_rank", "flops_per_rank", "bound"}; None without limits."""
    if not per_rank_work or any(not lim for lim in per_rank_limits) or len(per_rank_limits) != len(per_rank_work):
        return None
    out = {}
    for phase in ("prefill", "ttft"):
        found = phase_floor([w[phase] for w in per_rank_work], per_rank_limits)
        if found is None:
            return None
        out[phase] = found
    steps = [phase_floor([w["decode"][k] for w in per_rank_work], per_rank_limits)
             for k in range(min(len(w["decode"]) for w in per_rank_work))]
    if steps:
        median = statistics.median(s["s"] for s in steps)
        out["decode"] = {**min(steps, key=lambda s: abs(s["s"] - median)), "s": median,
                         "steps": len(steps)}
    if e2e_tokens and "decode" in out:
        out["e2e"] = {"s": out["ttft"]["s"] + (e2e_tokens - 1) * out["decode"]["s"], "new_tokens": e2e_tokens}
    return out


def of_limit(floor_s: float | None, measured_s: float | None) -> float | None:
    """floor / measured: the share of the machine's limit a measured time reaches (1 = at the limit)."""
    return floor_s / measured_s if floor_s and measured_s else None


def summary(per_rank: list[dict], ranks: int) -> dict:
    """The limits measured by a run's launches of `ranks` ranks as the record keeps them: every rank of every launch
    (`per_rank`, launch after launch), and the lowest of each (the slowest rank's: what a TP step waits for); a
    row's floor uses the limits of its own launch."""
    def lowest(key: str) -> float | None:
        values = [r.get(key) for r in per_rank]
        return min(values) if values and all(values) else None

    return {"ranks": ranks, "launches": len(per_rank) // max(ranks, 1), "per_rank": per_rank,
            "read_gb_s": (lowest("read_bytes_per_s") or 0) / 1e9 or None,
            "copy_gb_s": (lowest("copy_bytes_per_s") or 0) / 1e9 or None,
            "gemm_gflop_s": (lowest("gemm_flops_per_s") or 0) / 1e9 or None}
