"""vLLM's own OpenAI-compatible server over an export with the QuantMLA backend, on 127.0.0.1
only: a completion equals the packed generate's greedy text, and a burst of 64 concurrent
requests at a KV budget that forces preemption completes with each text equal to the same
request served alone. Every request loop is bounded in count and time."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving.conftest import REPO, WIKITEXT, project

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
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    command = [
        sys.executable, "-m", "quantmla.serving.serve", str(exports["v2_rtn_c4r4"]),
        "--kv-cache-memory-bytes", "36000000", "--max-num-seqs", "32", "--dtype", "float32",
        "--protection-dtype", "float32",
        "--max-model-len", "1024", "--port", str(port),
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text_file, out = tmp_path / "prompt.txt", tmp_path / "packed.json"
    prompt = tok.decode(prompt_ids[:600])
    text_file.write_text(prompt)
    project(
        "-m", "quantmla.generate", "model=tiny_mla_v2", f"model.path={model}", "precision=c4r4",
        "method=rtn", "cache.backend=packed", f"prompt_file={text_file}", "max_new_tokens=64",
        f"json_out={out}",
    )  # fmt: skip
    packed = json.loads(out.read_text())
    served = post(
        port, "/v1/completions",
        {"model": model, "prompt": packed["prompt_token_ids"], "max_tokens": 64, "temperature": 0.0},
    )["choices"][0]["text"]  # fmt: skip
    assert served == packed["text"]


def test_a_burst_under_preemption_completes_with_each_text_as_served_alone(server):
    port, model = server
    text = WIKITEXT.read_text()
    prompts = [text[5000 + 2500 * i : 5000 + 2500 * i + 400] for i in range(BURST)]  # ~100 tokens
    preempted = metric(port, "vllm:num_preemptions_total")
    with ThreadPoolExecutor(max_workers=BURST) as pool:
        together = list(pool.map(lambda p: complete(port, model, p), prompts, timeout=900))
    preemptions = metric(port, "vllm:num_preemptions_total") - preempted
    alone = [complete(port, model, p) for p in prompts]
    print(f"{BURST} concurrent requests: {preemptions:.0f} preemptions (recomputed)")
    assert preemptions > 0  # the budget really forced recompute
    assert all(len(t) for t in together)
    differ = [i for i, (a, b) in enumerate(zip(together, alone)) if a != b]
    assert not differ, f"requests {differ} differ from the same request served alone"
