"""Serving a patched dir as users launch it, on 2 real CPU ranks (tiny Qwen3-MoE, with a byte-level tokenizer).

* The README's serve.py, run as written: under DeepSpeed's launcher without OMP_NUM_THREADS (each rank gets its
  share of the cores), under torchrun without LOCAL_SIZE (the policy derives it), and as a plain `python serve.py`
  (tp_size 1, no launcher, no MPI).
* Sampling with a different seed on each rank gives the same tokens on both ranks.
* SIGKILL of one rank mid-generation ends the launcher and the other rank within seconds and leaves no DeepSpeed
  buffer in /dev/shm.
* `python -m codegen serve` end to end, driven by the official `openai` client on loopback: completions equal the
  single-process model's greedy tokens, streaming (with `include_usage`), chat with `max_completion_tokens`,
  `stop`, sampling parameters (seed, logit_bias, penalties, echo, logprobs), bad requests (one 4xx with OpenAI's
  error body each), the API key, a short request beside a long one, a client that leaves mid-stream, a full queue
  (429), 32 concurrent clients each getting its own greedy answer, /metrics; SIGINT to a background server and
  SIGTERM mid-generation stop every rank within seconds, free the port and leave no buffer. `python -m codegen
  generate` likewise. `--compile` (serve, then generate): the compiled ranks give the same greedy answers.
"""

from __future__ import annotations

import contextlib
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
import atexit, importlib.util, json, os, sys, torch
from codegen.models import load
model_dir, out, mode = sys.argv[1:4]
rank = int(os.environ["RANK"])
# registered first, so it runs last at exit: whether the policy ended the group it started before finalization
atexit.register(lambda: open(os.path.join(out, f"{rank}.group"), "w").write(str(torch.distributed.is_initialized())))
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
    from transformers import LogitsProcessorList
    def own_choice(input_ids, scores):  # a rank-dependent logits processor: rank r picks token 7 + r
        scores[:, 7 + rank] = scores.max() + 100.0
        return scores
    diverged = None
    try:  # the same inputs, different tokens at the first step: every rank stops there, none hangs
        engine.module.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                               logits_processor=LogitsProcessorList([own_choice]))
    except policy.PolicyError as exc:
        diverged = str(exc)
    json.dump({"tokens": o[0, 12:].tolist(), "refused": refused, "diverged": diverged},
              open(os.path.join(out, f"{rank}.json"), "w"))
    torch.distributed.barrier()  # after a refused step, both ranks meet; the policy ends the group at exit
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


def test_per_rank_seeds_give_the_same_tokens_and_different_prompts_or_tokens_stop_every_rank(served, tmp_path):
    proc = _torchrun(served, tmp_path, "lockstep")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert got[0]["tokens"] == got[1]["tokens"] and len(got[0]["tokens"]) == 24
    assert got[0]["refused"] == got[1]["refused"] and "were given different inputs to generate" in got[0]["refused"]
    assert got[0]["diverged"] == got[1]["diverged"] and "chose different tokens while generating" in got[0]["diverged"]
    # a gloo group left to interpreter finalization can abort a rank after its work (pytorch/pytorch#190489)
    assert [(tmp_path / f"{r}.group").read_text() for r in (0, 1)] == ["False", "False"]


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

API_KEY = "test-key"
#: the server's waiting-queue bound in these tests (the 429 test fills it)
MAX_WAITING = 40


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_server(served, *extra: str, background: bool = False) -> dict:
    """`python -m codegen serve DIR --tp 2 --port 0`, as a user starts it (`background`: with SIGINT ignored, as a
    shell starts a background job)."""
    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "codegen", "serve", str(served), "--tp", "2", "--port", "0",
                             "--dtype", "float32", *extra], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint if background else None)
    line = proc.stdout.readline()
    match = re.search(r"on http://([\d.]+):(\d+)/v1", line)
    assert match, (line, proc.stderr.read()[-2000:] if proc.poll() is not None else "")
    return {"host": match.group(1), "port": int(match.group(2)), "proc": proc, "ranks": _children(proc.pid)}


def _stop_server(server, sig) -> tuple[float, int]:
    """Send `sig` to the launcher: (seconds until it and every rank were gone, its exit code)."""
    proc = server["proc"]
    proc.send_signal(sig)
    started = time.monotonic()
    code = proc.wait(timeout=30)
    while any(_alive(pid) for pid in server["ranks"]) and time.monotonic() - started < 30:
        time.sleep(0.05)
    return time.monotonic() - started, code


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def server(served):
    """The server for the tests below, started as a background job would be (SIGINT ignored) with an API key;
    stopped with SIGINT at the end: every rank gone within seconds, the port free, no buffer left."""
    before = _buffers()
    server = _start_server(served, "--api-key", API_KEY, "--max-waiting", str(MAX_WAITING), background=True)
    assert len(server["ranks"]) == 2
    yield server
    took, code = _stop_server(server, signal.SIGINT)
    assert code == 130 and took < 10, f"SIGINT: exit {code} after {took:.1f}s"
    assert "interrupted: the ranks are stopped" in server["proc"].stderr.read()
    assert _port_free(server["host"], server["port"]) and _buffers() <= before


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://{server['host']}:{server['port']}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def _raw(server, method: str, path: str, raw: bytes | None = None, key: str | None = API_KEY,
         headers: dict | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection(server["host"], server["port"], timeout=120)
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    conn.request(method, path, body=raw, headers=sent)
    response = conn.getresponse()
    status, head, data = response.status, dict(response.getheaders()), response.read()
    conn.close()
    return status, json.loads(data) if data.startswith(b"{") else {"raw": data.decode()}, head


def _greedy_text(reference, prompt: str, n: int) -> tuple[str, str]:
    greedy, tokenizer = reference
    tokens, finish = greedy(prompt, n)
    return tokenizer.decode(tokens, skip_special_tokens=True), finish


def test_serve_and_generate_compiled_give_the_single_process_greedy_answers(served, reference):
    """`--compile`: the ranks shard with `init_inference(..., compile=True)`, so every step runs the compiled forward
    (prefill and decode graphs, every reduction inside them). `serve`, with rows joining and leaving a running batch
    (prompts of several lengths, then one alone): every answer is the single-process model's greedy one, and SIGTERM
    still stops every rank and leaves no buffer; then `generate` (its graphs from inductor's cache, warm). Compiled
    on 5.x; 4.x's loop over the routed experts breaks the graph: eager, said in one line per launch."""
    import openai
    from packaging.version import Version
    from transformers import __version__

    before = _buffers()
    server = _start_server(served, "--compile", "--max-batch", "4")
    try:
        # the first request of each shape kind compiles (cold on a fresh machine: about a minute)
        client = openai.OpenAI(base_url=f"http://{server['host']}:{server['port']}/v1", api_key="-", max_retries=0,
                               timeout=600)
        prompts = [PROMPT, "Hi", "A longer prompt, of a few more words than the others", "Then"]
        lengths = [10, 4, 7, 12]
        expected = [_greedy_text(reference, p, n) for p, n in zip(prompts, lengths)]
        results: dict[int, object] = {}

        def ask(i):
            results[i] = client.completions.create(model="qwen3_moe", prompt=prompts[i], max_tokens=lengths[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = [(results[i].choices[0].text, results[i].choices[0].finish_reason) if i in results else None
               for i in range(len(prompts))]
        assert got == expected
        alone = client.completions.create(model="qwen3_moe", prompt=prompts[2], max_tokens=9).choices[0]
        assert (alone.text, alone.finish_reason) == _greedy_text(reference, prompts[2], 9)
    finally:
        took, code = _stop_server(server, signal.SIGTERM)
    def eager_lines(stderr: str) -> int:
        return sum("cannot capture the forward as one graph" in line for line in stderr.splitlines())

    once_on_4x = 0 if Version(__version__).major >= 5 else 1
    stderr = server["proc"].stderr.read()
    assert eager_lines(stderr) == once_on_4x, stderr[-2000:]
    assert took < 10 and code == 130 and _buffers() <= before, f"SIGTERM: exit {code} after {took:.1f}s"

    tokens, finish = reference[0](PROMPT, 8)
    done = run_codegen("generate", served, "--tp", "2", "--prompt", PROMPT, "--max-tokens", "8", "--dtype",
                       "float32", "--json", "--compile")
    assert done.returncode == 0, done.stderr[-2000:]
    assert eager_lines(done.stderr) == once_on_4x, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    assert answer["tokens"] == tokens and answer["finish_reason"] == finish


def test_health_models_and_the_api_key(server, client):
    assert _raw(server, "GET", "/health", key=None)[1]["status"] == "ok"
    assert [m.id for m in client.models.list().data] == ["qwen3_moe"]
    import openai

    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    status, body, _ = _raw(server, "POST", "/v1/completions", json.dumps({"prompt": "x"}).encode(), key=None)
    assert status == 401 and body["error"]["type"] == "invalid_request_error"


def test_a_completion_is_the_single_process_models_greedy_answer(client, reference):
    greedy, tokenizer = reference
    tokens, finish = greedy(PROMPT, 12)
    answer = client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=12)
    assert answer.object == "text_completion"
    assert answer.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert answer.choices[0].finish_reason == finish
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(PROMPT.encode()), len(tokens))
    again = client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=12, user="someone")
    assert again.choices[0].text == answer.choices[0].text


def test_streaming_sends_the_same_text_and_the_usage_when_asked(client, reference):
    text, finish = _greedy_text(reference, PROMPT, 10)
    chunks = list(client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(PROMPT.encode())
    plain = list(client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=3, stream=True))
    assert all(c.usage is None for c in plain)


def test_chat_uses_the_template_and_max_completion_tokens(client):
    messages = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model="qwen3_moe", messages=messages, max_completion_tokens=3)
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == 3 and answer.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="qwen3_moe", messages=messages, max_completion_tokens=3,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 3


def test_a_stop_string_ends_the_answer_and_is_not_returned(client, reference):
    text, _ = _greedy_text(reference, PROMPT, 16)
    at = next(i for i, ch in enumerate(text) if i > 0 and ch.isascii() and ch.isprintable())
    stop = text[at]
    expected = text[:text.index(stop)]
    answer = client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=16, stop=[stop, "never!"])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_parameters_are_honoured(client):
    def text(**kw):
        return client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=8, **kw).choices[0].text

    assert text(logit_bias={"65": 100}) == "A" * 8  # token 65 is "A" for the byte-level tokenizer
    assert text(temperature=1.0, seed=7) == text(temperature=1.0, seed=7)
    assert len({text(temperature=1.5, seed=s) for s in range(4)}) > 1
    assert text(logit_bias={"65": 5}, frequency_penalty=2.0) != text(logit_bias={"65": 5})
    echoed = client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=4, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT) and echoed.choices[0].text != PROMPT
    scored = client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=4, logprobs=2)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4 and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    chat = client.chat.completions.create(model="qwen3_moe", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=3)
    assert len(chat.choices[0].logprobs.content) == 3 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    assert client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=4, presence_penalty=1.0,
                                     extra_body={"repetition_penalty": 1.3, "top_k": 5}).usage.completion_tokens


def test_bad_requests_get_one_4xx_with_openais_error_body(server, client):
    import openai

    def refused(param: str, **kw) -> str:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="qwen3_moe", **{"prompt": PROMPT, "max_tokens": 4, **kw})
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
        return info.value.body["message"]

    assert refused("frobnicate", extra_body={"frobnicate": 1}) == "Unrecognized request argument supplied: frobnicate"
    refused("n", n=2)
    refused("suffix", suffix="!")
    refused("best_of", best_of=3)
    refused("logprobs", logprobs=1, stream=True)
    refused("max_tokens", max_tokens=0)
    message = refused("prompt", prompt="x" * 5000)
    assert "maximum context length is 256 tokens" in message and "5000 tokens" in message
    message = refused("max_tokens", max_tokens=250)
    assert "256" in message and f"{len(PROMPT) + 250} tokens" in message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="qwen3_moe", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert info.value.body["param"] == "tools"
    for raw in (b"{not json", b"", b"\xff\xfe{", b"[1]", json.dumps({"prompt": "x" * (1 << 21)}).encode()):
        status, body, _ = _raw(server, "POST", "/v1/completions", raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (raw[:20], body)
    status, body, _ = _raw(server, "POST", "/v1/nothing", b"{}")
    assert status == 404 and "no such endpoint" in body["error"]["message"]
    status, body, _ = _raw(server, "GET", "/v1/completions")
    assert status == 405 and "error" in body
    status, _, _ = _raw(server, "POST", "/v1/completions", b'{"prompt": "x"}', headers={"Content-Length": "-5"})
    assert status == 400  # malformed HTTP: uvicorn's own plain-text 400, before any endpoint


def test_a_short_request_beside_a_long_one_is_answered_in_its_own_time(client, server):
    finished = {}
    running = threading.Event()

    def long():
        stream = client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=200, stream=True,
                                           logit_bias={"0": -100})
        for _ in stream:
            running.set()  # its first tokens are out: it is in the running batch (a fixed sleep raced fast steps)
        finished["long"] = time.monotonic()

    thread = threading.Thread(target=long)
    thread.start()
    assert running.wait(60)
    client.completions.create(model="qwen3_moe", prompt="Hi", max_tokens=4)
    finished["short"] = time.monotonic()
    thread.join()
    assert finished["short"] < finished["long"]


def test_a_client_that_leaves_mid_stream_frees_its_slot(client, server):
    stream = client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=200, stream=True,
                                       logit_bias={"0": -100})
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()
    answer = client.completions.create(model="qwen3_moe", prompt=PROMPT, max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 10
    while _raw(server, "GET", "/health")[1]["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _raw(server, "GET", "/health")[1]["running"] == 0
    # a client of a whole (non-streaming) answer that leaves: noticed, its slot freed
    body = json.dumps({"prompt": "x", "max_tokens": 250, "logit_bias": {"0": -100}}).encode()
    sock = socket.create_connection((server["host"], server["port"]), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " +
                 str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 10
    while not _raw(server, "GET", "/health")[1]["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    sock.close()
    left = time.monotonic()
    while _raw(server, "GET", "/health")[1]["running"] and time.monotonic() < left + 10:
        time.sleep(0.05)
    assert _raw(server, "GET", "/health")[1]["running"] == 0
    metrics = _raw(server, "GET", "/metrics", key=None)[1]["raw"]
    assert 'codegen_request_errors_total{model_name="qwen3_moe",status="499"} 1.0' in metrics  # cut short, not run out


def test_a_full_queue_is_a_429_with_retry_after(server):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "stream": True, "logit_bias": {"0": -100}}).encode()
    socks, heads = [], []
    try:
        for _ in range(8 + MAX_WAITING + 8):  # 8 running, MAX_WAITING waiting, the rest refused
            sock = socket.create_connection((server["host"], server["port"]), timeout=60)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " +
                         str(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(sock)
        for sock in socks:
            head = b""
            while b"\r\n\r\n" not in head or (head[9:12] == b"429" and not head.rstrip().endswith(b"}")):
                head += sock.recv(4096)
            heads.append(head.decode(errors="replace"))
    finally:
        for sock in socks:
            sock.close()
    statuses = [h.split()[1] for h in heads]
    # admission happens at step boundaries, so between 1 and 8 were running when the queue filled
    assert statuses.count("200") >= MAX_WAITING + 1 and statuses.count("429") >= 8, statuses
    assert statuses.count("200") + statuses.count("429") == len(statuses), statuses
    refused = next(h for h in heads if h.split()[1] == "429").lower()
    assert "retry-after: 1" in refused and "rate_limit_exceeded" in refused
    deadline = time.monotonic() + 30
    while (h := _raw(server, "GET", "/health")[1])["running"] + h["waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert h["running"] + h["waiting"] == 0  # every client that left freed its slot or place


def test_32_concurrent_clients_get_each_their_own_greedy_answer(client, server, reference, capsys):
    prompts = [f"Request number {i} says" for i in range(32)]
    expected = [_greedy_text(reference, p, 16) for p in prompts]
    results: dict[int, object] = {}

    def ask(i):
        results[i] = client.completions.create(model="qwen3_moe", prompt=prompts[i], max_tokens=16)

    started = time.monotonic()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    assert [(results[i].choices[0].text, results[i].choices[0].finish_reason) for i in range(32)] == expected
    tokens = sum(r.usage.completion_tokens for r in results.values())
    health = _raw(server, "GET", "/health")[1]
    assert health["largest_batch"] == 8  # --max-batch
    with capsys.disabled():
        print(f"\nserve, tiny Qwen3-MoE, tp 2, float32, 32 concurrent clients x 16 tokens: {tokens} tokens in "
              f"{wall:.2f}s = {tokens / wall:.1f} tokens/s; largest batch {health['largest_batch']}")


def test_metrics_in_prometheus_text_format(server):
    from prometheus_client.parser import text_string_to_metric_families

    assert _raw(server, "POST", "/v1/completions", b"{}")[0] == 400
    status, body, headers = _raw(server, "GET", "/metrics", key=None)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body["raw"]) for s in family.samples}
    value = {name: v for (name, labels), v in samples.items() if not dict(labels).get("le")}
    assert value["codegen_prompt_tokens_total"] > 0 and value["codegen_generation_tokens_total"] > 0
    assert value["codegen_time_to_first_token_seconds_count"] > 0
    assert value["codegen_inter_token_latency_seconds_count"] > 0
    assert value["codegen_num_requests_running"] == 0 and value["codegen_num_requests_waiting"] == 0
    assert sum(v for (n, _), v in samples.items() if n == "codegen_request_success_total") > 0
    assert sum(v for (n, labels), v in samples.items() if n == "codegen_request_errors_total"
               and dict(labels)["status"] == "400") > 0


def test_sigterm_mid_generation_stops_every_rank_frees_the_port_and_leaves_no_buffer(served):
    before = _buffers()
    server = _start_server(served)
    assert len(server["ranks"]) == 2
    def long():
        with contextlib.suppress(OSError, http.client.HTTPException):  # the server goes away mid-answer
            _raw(server, "POST", "/v1/completions", json.dumps(
                {"prompt": PROMPT, "max_tokens": 200, "logit_bias": {"0": -100}}).encode(), key=None)

    thread = threading.Thread(target=long, daemon=True)
    thread.start()
    time.sleep(1.0)  # generating
    took, code = _stop_server(server, signal.SIGTERM)
    assert took < 10 and not any(_alive(pid) for pid in server["ranks"]), f"SIGTERM: the ranks took {took:.1f}s"
    assert code == 130 and _port_free(server["host"], server["port"]) and _buffers() <= before


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
