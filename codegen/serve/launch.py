"""`serve` and `generate` as the user runs them: the checks that need no rank, then the ranks (codegen.ranks).

Before any rank starts: the dir must be a patched model dir (`python -m codegen patch` wrote its policy), hold a
tokenizer, and its sizes must divide by `--tp` (the family table's keys, on `text_config` where nested): anything
else is one line and exit 2. Then `tp` local ranks run codegen.serve.rank. `serve` prints the endpoint once rank
0 has it up and runs until Ctrl-C (the ranks are stopped; exit 130) or until a rank fails (the others are stopped;
the failing rank's line, exit 7). `generate` prints the one completion and exits 0.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from codegen.errors import BadInput, ServeFailed
from codegen.families import family_named, normalise_model_type
from codegen.modeldir.layout import CONFIG, POLICY_FILE
from codegen.patch.config import check_tp_divides
from codegen.ranks import LocalRanks, last_error_line
from codegen.serve.rank import READY

#: the files of a tokenizer a dir may hold (any one will do)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: the hidden `python -m codegen` subcommand every rank of `serve` / `generate` runs
SERVE_RANK = "_serve"


def check_servable(model_dir: Path, tp: int) -> str:
    """The dir's family, or BadInput (one line) when it cannot be served on `tp` ranks."""
    if tp < 1:
        raise BadInput(f"--tp must be a positive integer, got {tp}")
    if not (model_dir / CONFIG).is_file():
        raise BadInput(f"{model_dir}: no {CONFIG}: point serve at a patched model dir")
    if not (model_dir / POLICY_FILE).is_file():
        raise BadInput(f"{model_dir} is not patched (no {POLICY_FILE}): run `python -m codegen patch {model_dir}` first")
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise BadInput(f"{model_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the checkpoint's "
                       "tokenizer files into the dir")
    try:
        config = json.loads((model_dir / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"{model_dir / CONFIG} is unreadable ({exc}): fix or re-download it") from None
    family = normalise_model_type(config.get("model_type"))
    if family is None:
        raise BadInput(f"{model_dir / CONFIG}: model_type {config.get('model_type')!r} is not a family codegen serves")
    check_tp_divides(config, family_named(family), tp, model_dir / CONFIG)
    return family


def run(spec: dict, progress=None) -> dict | None:
    """Start the ranks on `spec`; for `serve`, run until Ctrl-C; for `generate`, return the answer."""
    with tempfile.TemporaryDirectory(prefix="codegen-serve-") as work:
        spec = {**spec, "answer": str(Path(work, "answer.json"))}
        spec_path = Path(work, "spec.json")
        spec_path.write_text(json.dumps(spec))
        ranks = LocalRanks([SERVE_RANK, "--spec", str(spec_path)], spec["tp"], Path(work), spec["device"]).start()
        announced = [False]

        def watch() -> None:
            if spec["mode"] == "serve" and not announced[0]:
                for line in Path(work, "rank0.log").read_text(errors="replace").splitlines():
                    if line.startswith(READY):
                        where = json.loads(line[len(READY):])
                        if progress is not None:
                            progress(f"serving {spec['model']} on http://{where['host']}:{where['port']}/v1 "
                                     f"(tp {spec['tp']}, {spec['dtype']}); Ctrl-C stops it")
                        announced[0] = True

        try:
            codes, _ = ranks.wait(None, watch)
        except KeyboardInterrupt:
            ranks.stop(grace_s=2.0)
            raise
        finally:
            text = ranks.output()
            ranks.close()
        failed = next((k for k, c in enumerate(codes) if c), None)
        if failed is not None:
            raise ServeFailed(f"{spec['mode']}: rank {failed} failed (exit {codes[failed]}): {last_error_line(text)}")
        answer = Path(spec["answer"])
        return json.loads(answer.read_text()) if answer.is_file() else None


def serve(model_dir: Path, tp: int, host: str, port: int, dtype: str, max_batch: int, device: str = "cpu",
          progress=None) -> None:
    check_servable(model_dir, tp)
    run({"mode": "serve", "model": str(model_dir), "tp": tp, "host": host, "port": port, "dtype": dtype,
         "max_batch": max_batch, "device": device, "name": model_dir.name}, progress)


def generate(model_dir: Path, tp: int, prompt: str, max_tokens: int, sampling: dict, dtype: str,
             device: str = "cpu") -> dict:
    check_servable(model_dir, tp)
    started = time.monotonic()
    answer = run({"mode": "generate", "model": str(model_dir), "tp": tp, "dtype": dtype, "max_batch": 1,
                  "device": device, "request": {"prompt": prompt, "max_tokens": max_tokens, "sampling": sampling}})
    if answer is None:
        raise ServeFailed("generate: rank 0 wrote no answer")
    answer["wall_s"] = time.monotonic() - started
    return answer


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
