"""vLLM's own OpenAI-compatible server over an export with the QuantMLA backend (vLLM's scheduler
defaults: chunked prefill on), on 127.0.0.1 only: a completion equals the packed generate's
greedy text, and a streaming burst of 64 concurrent requests at a KV budget that forces
preemption, a quarter aborted by their clients, completes with each finished text equal to the
same request in an unpressured run. Every request loop is bounded in count and time."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving.conftest import REPO, WIKITEXT, all_cores, child_env, packed_generate

BURST = 64
OUT_TOKENS = 96  # longer than the burst's prompts: the admitted requests cannot all grow in place


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    """The server under pressure: 36 MB of KV budget = 32.4 MB of protection rows (fp32, as the
    packed generate keeps them for an fp32 model) for 32 requests + 3.2K tokens of C4R4 pages."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {k: v for k, v in child_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    command = [
        sys.executable, "-m", "quantmla.serving.serve", str(exports["v2_rtn_c4r4"]),
        "--kv-cache-memory-bytes", "36000000", "--max-num-seqs", "32", "--dtype", "float32",
        "--protection-dtype", "float32",
        "--max-model-len", "1024", "--port", str(port),
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=all_cores
        )
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("the server did not come up within 240 s")
        yield port, str(exports["v2_rtn_c4r4"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def complete(port, model, prompt, n=OUT_TOKENS):
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0}
    return post(port, "/v1/completions", body)["choices"][0]["text"]


def test_a_completion_is_the_packed_generates_greedy_text(server, prompt_ids, tmp_path):
    port, model = server
    packed = packed_generate(model, prompt_ids, "c4r4", 64, tmp_path)  # shared with test_backend
    served = post(
        port, "/v1/completions",
        {"model": model, "prompt": packed["prompt_token_ids"], "max_tokens": 64, "temperature": 0.0},
    )["choices"][0]["text"]  # fmt: skip
    assert served == packed["text"]


def stream(port: int, model: str, prompt: str, n: int, abort_after: int | None = None):
    """A streaming completion's text, or None when the client hangs up after `abort_after` chunks
    (vLLM aborts a request whose connection closes)."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "stream": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    pieces = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
            if abort_after is not None and len(pieces) >= abort_after:
                return None
    return "".join(pieces)


def test_a_streaming_burst_with_aborts_under_preemption(server, exports):
    """64 concurrent streaming requests at a budget that forces preemption, chunked prefill on,
    every 4th aborted by its client midway; then 32 more at once (max_num_seqs: every protection
    slot must be free again). Each finished text = the same request in one unpressured engine run."""
    import gc

    from vllm import SamplingParams

    from quantmla.serving.engine import build_llm

    port, model = server
    text = WIKITEXT.read_text()
    prompts = [text[5000 + 2500 * i : 5000 + 2500 * i + 400] for i in range(BURST + 32)]
    reference = build_llm(
        model, dtype="float32", kv_cache_memory_bytes=400_000_000, max_num_seqs=BURST + 32,
        max_model_len=1024, quantmla={"protection_dtype": "float32"},
    )  # fmt: skip
    params = SamplingParams(max_tokens=OUT_TOKENS, temperature=0.0)
    alone = [o.outputs[0].text for o in reference.generate(prompts, params)]
    del reference
    gc.collect()

    preempted = metric(port, "vllm:num_preemptions_total")
    aborted = set(range(0, BURST, 4))
    with ThreadPoolExecutor(max_workers=BURST) as pool:
        burst = list(pool.map(
            lambda i: stream(port, model, prompts[i], OUT_TOKENS, 8 if i in aborted else None),
            range(BURST), timeout=900,
        ))  # fmt: skip
    preemptions = metric(port, "vllm:num_preemptions_total") - preempted
    with ThreadPoolExecutor(max_workers=32) as pool:
        later = list(pool.map(lambda p: complete(port, model, p), prompts[BURST:], timeout=900))
    print(f"{BURST} streaming requests, {len(aborted)} aborted: {preemptions:.0f} preemptions")
    assert preemptions > 0  # the budget really forced recompute
    assert all(burst[i] is None for i in aborted)
    finished = [i for i in range(BURST) if i not in aborted]
    differ = [i for i in finished if burst[i] != alone[i]]
    assert not differ, f"requests {differ} differ from the same request in an unpressured run"
    differ = [i for i, t in enumerate(later) if t != alone[BURST + i]]
    assert not differ, f"later requests {differ} differ"
