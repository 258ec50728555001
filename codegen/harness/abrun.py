"""The interleaved runs bench and demo share: build and patch the example dirs, run the worker's ab phase on
every (family, batch) in one launch, and summarise each into a row (codegen.harness.results.summarise_ab).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from codegen.errors import VerifyFailed
from codegen.families import EXAMPLES
from codegen.harness import limits as machine_limits
from codegen.harness.prepare import Progress, ab_spec, prepare_examples
from codegen.harness.results import ratios, summarise_ab

#: what each kind of run measures: `smoke` is the CI run (counts asserted, timings recorded but meaningless),
#: `toy` the default recorded run (scaled-down widths), `full` the published widths (2 layers, small vocab)
SETTINGS: dict[str, dict] = {
    "smoke": dict(size="tiny", prompt_len=32, batches=(1,), decode_steps=4, warmup=1, prefill_repeats=2,
                  patch_trials=1, setups=("stock", "codegen", "compiled", "native"), timeout=900.0, families_of="bench",
                  single=True, e2e_tokens=4, e2e_repeats=1, compile_warm=False, compile_cache_kept=True),
    "toy": dict(size="bench", prompt_len=128, batches=(1, 16), decode_steps=48, warmup=4, prefill_repeats=8,
                patch_trials=3, setups=("stock", "codegen", "compiled", "native"), timeout=3600.0, single=True, e2e_tokens=32,
                e2e_repeats=2),
    "full": dict(size="full", prompt_len=64, batches=(1, 16), decode_steps=16, warmup=2, prefill_repeats=3,
                 patch_trials=0, setups=("stock", "codegen", "compiled", "native"), timeout=4500.0, single=True, e2e_tokens=16,
                 e2e_repeats=1),
    # the demo: tiny dirs, counts and logits only, (a) vs (b); no machine limits (no times shown)
    "demo": dict(size="tiny", prompt_len=32, batches=(1,), decode_steps=2, warmup=1, prefill_repeats=1,
                 patch_trials=0, setups=("stock", "codegen"), timeout=600.0, limits=False),
}
#: (e)'s setup, run in a launch of one process after the tensor-parallel launches (`single` in SETTINGS)
SINGLE = ("single",)
#: why a row was not run (its `not_run_cause`): the memory plan refused it before anything was built, or its launch
#: failed (per-family launches: the other families' rows stand)
NOT_RUN_MEMORY, NOT_RUN_FAILED = "memory", "failed"
#: two interleaved groups sharing (b), when the three setups do not fit in memory side by side
PAIRS = (("stock", "codegen", "compiled"), ("codegen", "native"))


def families_of(kind: str) -> tuple[str, ...]:
    """The families a kind of run covers: those with an example shape of its size (the smoke run: the families the
    recorded bench covers, at tiny widths)."""
    from codegen.harness.examples import families_with

    settings = SETTINGS[kind]
    return families_with(settings.get("families_of", settings["size"]))


def run_ab(kind: str, families: tuple[str, ...], tp: int, device: str, root: Path, progress: Progress,
           echo_patch: bool = False, dtype: str = "float32", groups: dict[str, tuple] | None = None,
           after_launch: Callable[[tuple[str, ...]], None] | None = None,
           rounds: int = 1) -> tuple[list[dict], list[dict], dict, dict]:
    """Build, patch and run the ab phase of every (family, batch) in one launch: (rows, rank records, dirs, the
    machine limits the launches measured: {"tp": ..., "single": ...}, codegen.harness.limits.summary).

    `groups` gives, per family, the interleaved groups of setups (default: all of the kind's setups
    in one group); a family run in two groups gets one row, (b)'s figures from the first. `after_launch`: called
    after each launch (then one per family, failed or not) with the families it ran. `rounds` > 1 (with
    `after_launch`): each family's launch and hook are followed by rounds - 1 more of a launch of (b) and (f) alone
    (`round_jobs`) and the hook again; (f)'s timed decode steps and end-to-end runs of every round are pooled into
    its row (`pool_rounds`).
    """
    from codegen.harness.examples import shape_of
    from codegen.harness.launcher import launch
    from codegen.harness.opcache import codegen_cache, shm_op_cached

    settings = SETTINGS[kind]
    dirs = prepare_examples(families, settings["size"], root, progress, echo=echo_patch,
                            dtype=dtype if settings["size"] == "full" else "float32")
    if device == "cpu" and not shm_op_cached():
        progress("first run with this Python, torch and DeepSpeed: DeepSpeed JIT-compiles its CPU shared-memory "
                 "all-reduce (once, kept in codegen's cache dir; 1-3 minutes on 2 cores)")
    jobs = []
    for family in families:
        for batch in settings["batches"]:
            for g, setups in enumerate((groups or {}).get(family, (settings["setups"],))):
                jobs.append({"name": f"{family}/b{batch}/g{g}", "family": family, "batch": batch, "setups": setups})
    # full widths: one launch per family, so no rank carries one family's freed-but-kept heap into the next, and a
    # family whose launch fails (the kernel's OOM killer, a crash) costs its own rows only, said in them
    per_family = settings["size"] == "full" or after_launch is not None
    batches = [[f] for f in families] if per_family else [list(families)]
    in_rounds = rounds > 1 and after_launch is not None  # later rounds run between the hook's calls
    ranks: list[dict] = []
    measured: list[dict] = []  # every launch's per-rank limits (full widths: one launch per family)
    failed: dict[str, str] = {}  # family: why its launch failed (per-family launches only)
    for launched in batches:
        progress(f"starting {tp} {device.upper()} ranks ({', '.join(launched)}); every timed step runs each setup "
                 "back to back, in rotating order")
        spec = ab_spec(dirs, [job for job in jobs if job["family"] in launched], tp, device, dtype, settings)
        # the smoke run (CI) keeps compiled graphs in codegen's cache dir: a later run compiles from it, warm; a run
        # in rounds keeps the family's in the workdir, so its later rounds' (f) compile from the first one's
        cache = (str(codegen_cache() / "inductor") if settings.get("compile_cache_kept") else
                 str(root / "inductor" / launched[0]) if in_rounds else None)
        try:
            launched_ranks = launch(spec, tp, settings["timeout"], progress, what="benchmark", inductor_cache=cache)
        except VerifyFailed as exc:
            if not per_family:
                raise
            failed[launched[0]] = str(exc)
            progress(f"{launched[0]}: not run: {exc}")
            launched_ranks = []
        if after_launch is not None:
            after_launch(tuple(launched))
        again = round_jobs([job for job in jobs if job["family"] in launched]) if in_rounds and launched_ranks else []
        for r in range(1, rounds if again else 1):
            progress(f"{launched[0]}: round {r + 1} of {rounds}: (b) and (f) again, then the peer again")
            named = [{**job, "name": f"{job['name']}/r{r}"} for job in again]
            try:
                more = launch(ab_spec(dirs, named, tp, device, dtype, {**settings, "limits": False,
                                                                        "compile_warm": False}),
                              tp, settings["timeout"], progress, what=f"benchmark round {r + 1}", inductor_cache=cache)
            except VerifyFailed as exc:  # the first round's figures stand; said on progress
                progress(f"{launched[0]}: round {r + 1} not run: {exc}")
                break
            pool_rounds(launched_ranks, more, {job["name"]: f"{job['name']}/r{r}" for job in again})
            after_launch(tuple(launched))
        for k, rank in enumerate(launched_ranks):
            measured.append(rank.get("limits") or {})
            if k < len(ranks):
                ranks[k]["jobs"].update(rank["jobs"])
            else:
                ranks.append(rank)
    ran = tuple(f for f in families if f not in failed)
    if not ran:
        raise VerifyFailed(next(iter(failed.values())))
    singles, single_limits = (_run_single(dirs, ran, device, dtype, settings, progress, per_family)
                              if settings.get("single") else ({}, None))
    rows = [{"family": f, "label": label(f), "size": settings["size"], "batch": batch, "dtype": dtype,
             "not_run": reason, "not_run_cause": NOT_RUN_FAILED} for f, reason in failed.items()
            for batch in settings["batches"]]
    for family in ran:
        shape = shape_of(dirs[family]["unpatched"], family, settings["size"])
        for batch in settings["batches"]:
            parts = [summarise_ab([r["jobs"][job["name"]]["ab"] for r in ranks], shape)
                     for job in jobs if job["family"] == family and job["batch"] == batch]
            row = {"family": family, "label": label(family), "size": settings["size"], **parts[0]}
            single = singles.get((family, batch))
            if single is not None:  # (e), from its own launch: the same prompt and forced tokens
                row["single"] = summarise_ab([single], shape)["single"]
                row["ratio_b_over_e"] = ratios(row["codegen"], row["single"])
            for part in parts[1:]:  # a second group: (d) against its own (b)
                row["native"], row["ratio_b_over_d"] = part["native"], part["ratio_b_over_d"]
                row["codegen_beside_native"] = part["codegen"]
            if len(parts) > 1:
                row["groups"] = [list(job["setups"]) for job in jobs
                                 if job["family"] == family and job["batch"] == batch]
            rows.append(row)
    limits = {"tp": machine_limits.summary(measured, tp)}
    if single_limits is not None:
        limits["single"] = machine_limits.summary([single_limits], 1)
    return rows, ranks, dirs, limits


def _run_single(dirs: dict, families: tuple[str, ...], device: str, dtype: str, settings: dict,
                progress: Progress, per_family: bool = False) -> tuple[dict, dict | None]:
    """(e): every (family, batch) in one launch of ONE process holding every core the ranks had together (the
    launcher gives a launch's ranks the cores between them): ({(family, batch): its ab record}, its limits).
    `per_family`: one launch per family, and a family whose launch fails has no (e), said on progress."""
    from codegen.harness.launcher import launch

    singles, limits = {}, None
    for launched in ([f] for f in families) if per_family else [list(families)]:
        jobs = [{"name": f"{family}/b{batch}/e", "family": family, "batch": batch, "setups": SINGLE}
                for family in launched for batch in settings["batches"]]
        progress(f"starting (e): the unpatched model in one {device.upper()} process on all cores "
                 f"({', '.join(launched)}); after the tensor-parallel launch, the same prompts and forced tokens")
        try:
            (rank,) = launch(ab_spec(dirs, jobs, 1, device, dtype, settings), 1, settings["timeout"], progress,
                             what="benchmark (e)")
        except VerifyFailed as exc:
            if not per_family:
                raise
            progress(f"{launched[0]}: (e) not run: {exc}")
            continue
        singles.update({(job["family"], job["batch"]): rank["jobs"][job["name"]]["ab"] for job in jobs})
        limits = limits or rank.get("limits") or {}
    return singles, limits


#: what a later round of a run in rounds loads: (f) and the (b) it compiles
ROUND_SETUPS = ("codegen", "compiled")
#: (f)'s timings a later round adds to the first's (its decode steps, and its end-to-end runs with their first tokens)
POOLED = ("decode_s", "e2e_s", "ttft_s")


def round_jobs(jobs: list[dict]) -> list[dict]:
    """A later round's jobs: per (family, batch), the first launch's job that ran (f), with (b) and (f) alone."""
    return [{**job, "setups": ROUND_SETUPS} for job in jobs if "compiled" in job["setups"]]


def pool_rounds(first: list[dict], later: list[dict], names: dict[str, str]) -> None:
    """Add a later round's (f) timings to the first launch's rank records (rank by rank; `names`: first job ->
    the round's job), so every figure drawn from them is over all rounds; `pooled_rounds` counts them. A round
    whose (f) crashed or did not run adds nothing."""
    for mine, theirs in zip(first, later):
        for job, again in names.items():
            compiled = mine["jobs"].get(job, {}).get("ab", {}).get("compiled")
            extra = theirs["jobs"].get(again, {}).get("ab", {}).get("compiled")
            if not compiled or not extra or compiled.get("crashed") or extra.get("crashed"):
                continue
            for key in POOLED:
                if key in compiled and key in extra:
                    compiled[key] = compiled[key] + extra[key]
            compiled["pooled_rounds"] = compiled.get("pooled_rounds", 1) + 1


def label(family: str) -> str:
    """What the bench and README call a family's bench-sized example."""
    known = EXAMPLES.get(family)
    return known.bench_label if known is not None and known.bench_label else family


def size_name(size: str) -> str:
    """The CLI's name of an example size: `bench` shapes are what `--size toy` runs."""
    return {"bench": "toy"}.get(size, size)
