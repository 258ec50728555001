"""Serving a patched dir as users launch it, on 2 real CPU ranks (tiny Qwen3-MoE, with a byte-level tokenizer).

* The README's serve.py, run as written: under DeepSpeed's launcher without OMP_NUM_THREADS (each rank gets its
  share of the cores), under torchrun without LOCAL_SIZE (the policy derives it), and as a plain `python serve.py`
  (tp_size 1, no launcher, no MPI).
* Sampling with a different seed on each rank gives the same tokens on both ranks.
* SIGKILL of one rank mid-generation ends the launcher and the other rank within seconds and leaves no DeepSpeed
  buffer in /dev/shm.
* `python -m codegen serve` end to end with an HTTP client on localhost: completions equal the single-process
  model's greedy tokens, streaming, chat, a bad request's 4xx, a client that drops mid-stream, 8 concurrent
  clients batched together; Ctrl-C stops it. `python -m codegen generate` likewise.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_codegen

pytestmark = [pytest.mark.runtime, pytest.mark.once]

BIN = Path(sys.executable).parent
PROMPT = "The capital of France is"


def _readme_script() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("In your own program, with any launcher:"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]


@pytest.fixture(scope="module")
def served(_tiny_templates, tmp_path_factory) -> Path:
    """A patched tiny Qwen3-MoE dir with a tokenizer (what `serve` and the README's script need)."""
    from codegen.harness.examples import build_tokenizer
    from codegen.patch import api

    directory = tmp_path_factory.mktemp("serving") / "qwen3_moe"
    shutil.copytree(_tiny_templates["qwen3_moe"], directory)
    build_tokenizer(directory)
    api.patch(directory)
    return directory


@pytest.fixture(scope="module")
def reference(_tiny_templates):
    """The unpatched model in one process: greedy tokens of a prompt, as serve's answer must be."""
    import torch
    from transformers import AutoTokenizer

    from codegen.harness.examples import build_tokenizer
    from codegen.models import load

    model = load(_tiny_templates["qwen3_moe"], False, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(Path(str(_tiny_templates["qwen3_moe"]) + "-tok")))

    def greedy(prompt: str, n: int) -> tuple[list[int], str]:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=0, pad_token_id=0)
        tokens = out[0, ids.shape[1]:].tolist()
        if 0 in tokens:
            tokens = tokens[:tokens.index(0)]
        return tokens, ("stop" if len(tokens) < n else "length")

    return greedy, tokenizer


def _buffers() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"deepspeed_allreduce_buffer_{os.getuid()}_")}


def _run(cmd: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _env(**changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_SIZE", "RANK", "WORLD_SIZE")}
    env.update({"PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"})
    env.update({k: v for k, v in changes.items() if v is not None})
    return env


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


# --------------------------------------------------------------------------------------- the README's serve.py


def test_readme_script_under_deepspeeds_launcher_without_omp_num_threads(served, tmp_path, reference):
    script = tmp_path / "serve.py"
    script.write_text(_readme_script())
    before = _buffers()
    done = _run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", _port(), str(script), str(served)],
                _env())
    assert done.returncode == 0, done.stderr[-3000:]
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"OMP_NUM_THREADS is unset: each of the 2 local ranks uses {threads} thread(s)" in done.stderr
    assert _buffers() <= before


def test_readme_script_under_torchrun_without_local_size(served, tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(_readme_script())
    done = _run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", _port(), str(script), str(served)],
                _env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "codegen policy: LOCAL_SIZE set to 2 from LOCAL_WORLD_SIZE" in done.stderr
    assert "Segmentation fault" not in done.stderr and "SIGSEGV" not in done.stderr


def test_readme_script_as_one_plain_process(served, tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(_readme_script())
    done = _run([sys.executable, str(script), str(served)], _env(OMP_NUM_THREADS="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no launcher: running as the one rank of a local group (tp_size 1)" in done.stderr
    assert "mpi4py" not in done.stderr and done.stdout.strip()


RANK_SCRIPT = """
import importlib.util, json, os, sys, torch
from codegen.models import load
model_dir, out, mode = sys.argv[1:4]
rank = int(os.environ["RANK"])
model = load(model_dir, True, torch.float32)
spec = importlib.util.spec_from_file_location("autotp_policy", os.path.join(model_dir, "autotp_policy.py"))
policy = importlib.util.module_from_spec(spec); spec.loader.exec_module(policy)
engine = policy.init_inference(model, tp_size=2, dtype=torch.float32)
ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(1234))
if mode == "lockstep":
    torch.manual_seed(42 + rank)  # per-rank seeds: sampling must still agree
    o = engine.module.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=24,
                               do_sample=True, temperature=0.8)
    refused = None
    try:  # every rank a prompt of its own: the ranks must refuse together, not hang
        engine.module.generate(ids + rank, max_new_tokens=4, do_sample=False, pad_token_id=0)
    except policy.PolicyError as exc:
        refused = str(exc)
    json.dump({"tokens": o[0, 12:].tolist(), "refused": refused}, open(os.path.join(out, f"{rank}.json"), "w"))
else:  # long: for the kill test
    open(os.path.join(out, f"{rank}.pid"), "w").write(str(os.getpid()))
    engine.module.generate(ids, max_new_tokens=2000, min_new_tokens=2000, do_sample=False, pad_token_id=0)
"""


def _torchrun(served, tmp_path, mode) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = _env(OMP_NUM_THREADS="1", LOCAL_SIZE="2", PYTHONPATH=str(ROOT))
    return subprocess.Popen([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", _port(), str(script),
                             str(served), str(tmp_path), mode], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_per_rank_seeds_give_the_same_tokens_and_different_prompts_stop_every_rank(served, tmp_path):
    proc = _torchrun(served, tmp_path, "lockstep")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert got[0]["tokens"] == got[1]["tokens"] and len(got[0]["tokens"]) == 24
    assert got[0]["refused"] == got[1]["refused"] and "were given different inputs to generate" in got[0]["refused"]


def test_sigkill_of_one_rank_mid_generation_ends_the_rest_fast_and_leaves_no_buffer(served, tmp_path):
    before = _buffers()
    proc = _torchrun(served, tmp_path, "long")
    try:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"{r}.pid").exists() for r in (0, 1)) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # generating
        pids = [int((tmp_path / f"{r}.pid").read_text()) for r in (0, 1)]
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - killed
        rank0_alive = Path(f"/proc/{pids[0]}").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < 10 and not rank0_alive, f"the rest took {took:.1f}s"
    assert _buffers() <= before


# ----------------------------------------------------------------------------------------- `codegen serve`


@pytest.fixture(scope="module")
def server(served):
    """`python -m codegen serve DIR --tp 2 --port 0`, as a user starts it; stopped with Ctrl-C at the end."""
    before = _buffers()
    proc = subprocess.Popen([sys.executable, "-m", "codegen", "serve", str(served), "--tp", "2", "--port", "0",
                             "--dtype", "float32"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r"on http://([\d.]+):(\d+)/v1", line)
    assert match, (line, proc.stderr.read()[-2000:] if proc.poll() is not None else "")
    yield {"host": match.group(1), "port": int(match.group(2)), "proc": proc}
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    code = proc.wait(timeout=30)
    assert code == 130 and time.monotonic() - started < 10
    assert "interrupted: the ranks are stopped" in proc.stderr.read()
    assert _buffers() <= before


def _post(server, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server["host"], server["port"], timeout=120)
    conn.request("POST", path, body=raw if raw is not None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def _get(server, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server["host"], server["port"], timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    result = response.status, json.loads(response.read())
    conn.close()
    return result


def _stream(server, path: str, body) -> list[dict]:
    conn = http.client.HTTPConnection(server["host"], server["port"], timeout=120)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    events = []
    for line in response.read().decode().split("\n\n"):
        if line.startswith("data: "):
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: "):]))
    conn.close()
    return events


def test_health_and_models(server):
    assert _get(server, "/health")[1]["status"] == "ok"
    status, models = _get(server, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "qwen3_moe"


def test_a_completion_is_the_single_process_models_greedy_answer(server, reference):
    greedy, tokenizer = reference
    tokens, finish = greedy(PROMPT, 12)
    status, body = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12})
    assert status == 200 and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=True) and choice["finish_reason"] == finish
    assert body["usage"] == {"prompt_tokens": len(PROMPT.encode()), "completion_tokens": len(tokens),
                             "total_tokens": len(PROMPT.encode()) + len(tokens)}


def test_streaming_sends_the_same_text_as_events(server):
    _, whole = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10})
    events = _stream(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10})
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]


def test_chat_uses_the_dirs_template(server):
    status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 4})
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    events = _stream(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"} and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == \
        body["choices"][0]["message"]["content"]


def test_bad_requests_get_a_4xx_json_error(server):
    status, body = _post(server, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = _post(server, "/v1/nothing", {})
    assert status == 404 and "no such endpoint" in body["error"]["message"]


def test_a_client_that_drops_mid_stream_leaves_the_server_serving(server):
    sock = socket.create_connection((server["host"], server["port"]), timeout=60)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    seen = b""
    while b"data: " not in seen:  # the stream has started
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    sock.close()
    status, answer = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")


def test_eight_concurrent_clients_are_batched(server, reference, capsys):
    greedy, tokenizer = reference
    prompts = [f"Request number {i} says" for i in range(8)]
    results: dict[int, tuple[int, dict]] = {}

    def client(i):
        results[i] = _post(server, "/v1/completions", {"prompt": prompts[i], "max_tokens": 16})

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    assert all(status == 200 for status, _ in results.values()) and len(results) == 8
    tokens = sum(body["usage"]["completion_tokens"] for _, body in results.values())
    health = _get(server, "/health")[1]
    assert health["largest_batch"] > 1
    with capsys.disabled():
        print(f"\nserve, tiny Qwen3-MoE, tp 2, float32, 8 concurrent clients x 16 tokens: {tokens} tokens in "
              f"{wall:.2f}s = {tokens / wall:.1f} tokens/s; largest batch {health['largest_batch']}")


def test_generate_prints_the_greedy_completion(served, reference):
    greedy, _ = reference
    tokens, finish = greedy(PROMPT, 8)
    done = run_codegen("generate", served, "--tp", "2", "--prompt", PROMPT, "--max-tokens", "8", "--dtype",
                       "float32", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    assert answer["tokens"] == tokens and answer["finish_reason"] == finish
    bad = run_codegen("generate", served, "--tp", "3", "--prompt", PROMPT)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: {served / 'config.json'}: --tp 3 does not divide num_attention_heads = 4: pick a tensor-parallel "
        "size that divides it"]
