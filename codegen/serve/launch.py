"""`serve` and `generate` as the user runs them: the checks that need no rank, then the ranks (codegen.ranks).

Before any rank starts: the dir must be a patched model dir (`python -m codegen patch` wrote its policy), hold a
tokenizer, and its sizes must divide by `--tp` (the family table's keys, on `text_config` where nested): anything
else is one line and exit 2. Then `tp` local ranks run codegen.serve.rank. `serve` prints the endpoint once rank
0 has it up and runs until Ctrl-C (the ranks are stopped; exit 130) or until a rank fails (the others are stopped;
the failing rank's line, exit 7). SIGTERM, and SIGINT even where the shell ignores it for a background job, stop
it like Ctrl-C; the ranks also die with the launcher if it is killed. `generate` prints the one completion and
exits 0.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from codegen.errors import BadInput, ServeFailed
from codegen.modeldir.layout import CONFIG, POLICY_FILE
from codegen.patch.config import check_rank_dir
from codegen.rank_commands import SERVE_RANK
from codegen.ranks import LocalRanks, last_error_line
from codegen.serve.rank import READY

#: the files of a tokenizer a dir may hold (any one will do)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_servable(model_dir: Path, tp: int) -> str:
    """The dir's family, or BadInput (one line) when it cannot be served on `tp` ranks."""
    family = check_rank_dir(model_dir, tp, "serve")
    if family is None:
        model_type = json.loads((model_dir / CONFIG).read_text()).get("model_type")
        raise BadInput(f"{model_dir / CONFIG}: model_type {model_type!r} is not a family codegen serves")
    if not (model_dir / POLICY_FILE).is_file():
        raise BadInput(f"{model_dir} is not patched (no {POLICY_FILE}): run `python -m codegen patch {model_dir}` first")
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise BadInput(f"{model_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the checkpoint's "
                       "tokenizer files into the dir")
    return family


#: how the policy starts each line it says once on stderr (a setting it chose, a compiled forward run eager)
POLICY_NOTE = "codegen policy: "


class PolicyNotes:
    """Rank 0's policy lines, passed on to this command's stderr as they appear (the ranks' own output stays in
    their logs): what the policy decided is the user's to see."""

    def __init__(self, log: Path) -> None:
        self.log, self.offset, self.partial = log, 0, b""

    def __call__(self) -> None:
        if not self.log.is_file():
            return
        with self.log.open("rb") as f:
            f.seek(self.offset)
            new = f.read()
        self.offset += len(new)
        *lines, self.partial = (self.partial + new).split(b"\n")
        for line in lines:
            text = line.decode(errors="replace").rstrip("\r")
            if text.startswith(POLICY_NOTE):
                print(text, file=sys.stderr, flush=True)


def run(spec: dict, progress=None) -> dict | None:
    """Start the ranks on `spec`; for `serve`, run until Ctrl-C; for `generate`, return the answer."""
    with tempfile.TemporaryDirectory(prefix="codegen-serve-") as work:
        spec = {**spec, "answer": str(Path(work, "answer.json"))}
        spec_path = Path(work, "spec.json")
        spec_path.write_text(json.dumps(spec))
        ranks = LocalRanks([SERVE_RANK, "--spec", str(spec_path)], spec["tp"], Path(work), spec["device"]).start()
        announced = [False]
        notes = PolicyNotes(Path(work, "rank0.log"))

        def watch() -> None:
            notes()
            if spec["mode"] == "serve" and not announced[0]:
                for line in Path(work, "rank0.log").read_text(errors="replace").splitlines():
                    if line.startswith(READY):
                        where = json.loads(line[len(READY):])
                        if progress is not None:
                            progress(f"serving {spec['model']} on http://{where['host']}:{where['port']}/v1 "
                                     f"(tp {spec['tp']}, {spec['dtype']}); Ctrl-C stops it")
                        announced[0] = True

        restore = _stop_on_signals()
        try:
            codes, _ = ranks.wait(None, watch)
        except KeyboardInterrupt:
            ranks.stop(grace_s=2.0)
            raise
        finally:
            restore()
            text = ranks.output()
            ranks.close()
        failed = next((k for k, c in enumerate(codes) if c), None)
        if failed is not None:
            own = Path(work, f"rank{failed}.log")  # its own line, not a peer's "connection closed" after it
            line = last_error_line(own.read_text(errors="replace") if own.is_file() else text)
            raise ServeFailed(f"{spec['mode']}: rank {failed} failed (exit {codes[failed]}): {line}")
        answer = Path(spec["answer"])
        return json.loads(answer.read_text()) if answer.is_file() else None


def serve(model_dir: Path, tp: int, host: str, port: int, dtype: str, max_batch: int, device: str = "cpu",
          progress=None, **options) -> None:
    """`options`: max_model_len, max_num_tokens, max_waiting, api_key, request_timeout, limit_concurrency (None:
    the default), compile (the ranks' forward compiled)."""
    check_servable(model_dir, tp)
    options = {k: v for k, v in options.items() if v is not None}
    wanted = options.get("max_model_len")
    if wanted is not None:
        context = model_context(model_dir)
        if wanted < 2:
            raise BadInput(f"--max-model-len must be at least 2, got {wanted}")
        if context is not None and wanted > context:
            raise BadInput(f"--max-model-len {wanted} is longer than the model's context ({context} tokens, "
                           f"max_position_embeddings in {model_dir / CONFIG})")
    run({"mode": "serve", "model": str(model_dir), "tp": tp, "host": host, "port": port, "dtype": dtype,
         "max_batch": max_batch, "device": device, "name": model_dir.name, **options}, progress)


def check_serve_installed() -> None:
    """The HTTP stack `serve` needs (the `serve` extra), else one line (exit 2)."""
    import importlib.util

    missing = [name for name in ("uvicorn", "starlette", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        raise BadInput(f"serve needs {', '.join(missing)}: pip install 'codegen[runtime,serve]'")


def model_context(model_dir: Path) -> int | None:
    """max_position_embeddings of the dir's config (on text_config where nested), if it has one."""
    try:
        config = json.loads((model_dir / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    for cfg in (config.get("text_config"), config):
        value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _stop_on_signals():
    """SIGTERM (process managers, `kill`) and SIGINT (also when started in the background, where the shell set it
    to be ignored) end the wait like Ctrl-C: the ranks are stopped. Returns what puts the old handlers back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(sig, handler) for sig, handler in old.items()]


def generate(model_dir: Path, tp: int, prompt: str, max_tokens: int, sampling: dict, dtype: str,
             device: str = "cpu", compile: bool = False) -> dict:
    check_servable(model_dir, tp)
    started = time.monotonic()
    answer = run({"mode": "generate", "model": str(model_dir), "tp": tp, "dtype": dtype, "max_batch": 1,
                  "device": device, "compile": compile,
                  "request": {"prompt": prompt, "max_tokens": max_tokens, "sampling": sampling}})
    if answer is None:
        raise ServeFailed("generate: rank 0 wrote no answer")
    answer["wall_s"] = time.monotonic() - started
    return answer


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
