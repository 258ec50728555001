"""Every family of the table on 2 real DeepSpeed CPU ranks under its own generated policy, in ONE launch.

For each family: a tiny random checkpoint from the table's config class and `codegen.examples.SHAPES["tiny"]`,
patched by the CLI (a subprocess, as a user runs it); then 2 ranks (tests/families_tp_rank.py, started with
torchrun's environment) load every patched dir in turn and apply `autotp_policy.init_inference` (tp_size 2).
Asserted per family and rank: logits within 1e-5 of one process (the pristine dir, transformers' built-in
model), all-reduces per forward = attention layers + MoE layers + dense MLPs + 1 (LM head), routed experts
at 1/2 per rank (expert biases that cannot split, e.g. a down bias kept whole on every rank, may add a
little), routers intact, greedy tokens equal, and the same count on both ranks.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codegen.examples import SHAPES
from codegen.families import FAMILIES

pytestmark = pytest.mark.runtime

ROOT = Path(__file__).resolve().parent.parent
RANK_SCRIPT = ROOT / "tests" / "families_tp_rank.py"
TP = 2
TOL = 1e-5
#: routed experts per rank: 1/2, plus what cannot split (at most 2 % of the bytes in these shapes)
EXPERT_SHARE, EXPERT_SLACK = 0.5, 0.02
TIMEOUT = 900


def _families() -> list[str]:
    import transformers

    have = []
    for name, family in FAMILIES.items():
        if name in SHAPES["tiny"] and hasattr(transformers, family.config_class):
            have.append(name)
    return have


FAMILY_NAMES = _families()


def _build(name: str, out: Path) -> Path:
    """A random hub-format checkpoint of the family's tiny shape (random but non-trivial routers and experts)."""
    import torch
    import transformers

    config = getattr(transformers, FAMILIES[name].config_class)(**SHAPES["tiny"][name])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    model.save_pretrained(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, pairs: list[str]) -> tuple[list[int], str]:
    """Start TP ranks as torchrun would (env:// rendezvous); stop the rest when one fails or time runs out."""
    from codegen.runtime import extensions_dir

    port = _free_port()
    base = {"TORCH_EXTENSIONS_DIR": extensions_dir(), **os.environ, "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": str(TP), "LOCAL_WORLD_SIZE": str(TP),
            # DeepSpeed's CPU shared-memory all-reduce segfaults without LOCAL_SIZE (its launcher sets it)
            "LOCAL_SIZE": str(TP), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    procs, logs = [], []
    deadline = time.monotonic() + TIMEOUT
    try:
        for rank in range(TP):
            log = open(out / f"rank{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(out), str(TP), *pairs],
                                          env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=log, stderr=subprocess.STDOUT))
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        codes = [p.wait() for p in procs]
        text = ""
        for log in logs:
            log.seek(0)
            text += log.read()
            log.close()
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"):
            try:
                os.unlink(path)
            except OSError:
                pass
    return codes, text


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    """{family: [rank 0 figures, rank 1 figures]} from one launch of 2 ranks over every family's dir."""
    base = tmp_path_factory.mktemp("families-tp")
    pairs = []
    for name in FAMILY_NAMES:
        pristine = _build(name, base / f"{name}.pristine")
        patched = base / name
        shutil.copytree(pristine, patched)
        done = subprocess.run([sys.executable, "-m", "codegen", "patch", "-q", str(patched)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{name}: patch failed: {done.stderr.strip()}"
        pairs.append(f"{patched}:{pristine}")
    out = base / "ranks"
    out.mkdir()
    codes, logs = _launch(out, pairs)
    assert codes == [0] * TP, f"ranks exited {codes}:\n{logs[-4000:]}"
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(TP)]
    return {name: [r[name] for r in ranks] for name in FAMILY_NAMES}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_on_two_ranks_matches_one_process_with_one_reduction_per_layer(measured, family):
    ranks = measured[family]
    for rank, r in enumerate(ranks):
        where = f"{family} rank {rank}"
        assert r["maxdiff"] <= TOL, f"{where}: logits diff {r['maxdiff']:.2e}"
        assert r["moe_layers"] >= 1, where
        assert r["allreduce_per_forward"] == r["expected_allreduce"], f"{where}: {r}"
        assert EXPERT_SHARE <= r["expert_bytes_ratio"] <= EXPERT_SHARE + EXPERT_SLACK, f"{where}: {r}"
        assert r["routers_intact"] is True, where
        assert r["tokens_equal"] is True, where
    assert len({r["allreduce_per_forward"] for r in ranks}) == 1, f"{family}: ranks issued different counts"
