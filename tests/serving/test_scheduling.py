"""vLLM's own scheduling over the packed cache: chunked prefill at any chunk size gives the
simulator's log-probs and the packed generate's text; a plain `vllm.LLM(EXPORT)` (vLLM's
defaults, compiled mode, a worker process) serves it and answers refusals in the user's process;
prefix caching is switched off with one line and refused when asked for."""

import gc
import json
import subprocess
import sys

import pytest

from quantmla.errors import QuantMLAError
from quantmla.serving.engine import build_llm, engine_args
from quantmla.serving.platform import PREFIX_CACHING_OFF, PREFIX_CACHING_REFUSED
from tests.serving.conftest import (
    REPO,
    WIKITEXT,
    all_cores,
    child_env,
    packed_generate,
    reference_logprobs,
)  # fmt: skip

PROMPT, GREEDY = 1500, 32


@pytest.fixture(scope="module")
def long_prompt(exports) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exports["v2_rtn_c4r4"])
    return tok(WIKITEXT.read_text()[1000:20000]).input_ids[:PROMPT]


@pytest.fixture(scope="module")
def references(exports, long_prompt, tmp_path_factory):
    """Per precision: the packed generate's greedy tokens and the simulator's teacher-forced
    log-probs over prompt + those tokens (computed once, in the project's venv)."""
    made = {}

    def get(precision):
        if precision not in made:
            tmp = tmp_path_factory.mktemp(precision)
            model = exports[f"v2_rtn_{precision}"]
            tokens = packed_generate(model, long_prompt, precision, GREEDY, tmp)["token_ids"]
            sim = reference_logprobs(model, long_prompt + tokens, precision, tmp)
            made[precision] = tokens, sim
        return made[precision]

    return get


@pytest.mark.parametrize("precision", ["c4r4", "c2r4"])
@pytest.mark.parametrize("chunk", [16, 48, 100, 512])
def test_chunked_prefill_equals_the_simulator_and_the_packed_generate(
    exports, long_prompt, references, precision, chunk
):
    from vllm import SamplingParams

    tokens, sim = references(precision)
    llm = build_llm(
        exports[f"v2_rtn_{precision}"], dtype="float32", kv_cache_memory_bytes=64_000_000,
        max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=chunk,
        quantmla={"protection_dtype": "float32"},
    )  # fmt: skip
    sched = llm.llm_engine.vllm_config.scheduler_config
    assert sched.enable_chunked_prefill and sched.max_num_batched_tokens == chunk
    params = SamplingParams(
        max_tokens=GREEDY, temperature=0.0, prompt_logprobs=0, logprobs=0, ignore_eos=True
    )
    out = llm.generate([{"prompt_token_ids": long_prompt}], params)[0]
    del llm
    gc.collect()
    got = [out.prompt_logprobs[t][long_prompt[t]].logprob for t in range(1, PROMPT)]
    prefill = max(abs(g - w) for g, w in zip(got, sim[1:PROMPT]))
    served = list(out.outputs[0].token_ids)
    decode_lps = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, served)]
    decode = max(abs(g - w) for g, w in zip(decode_lps, sim[PROMPT:]))
    print(f"{precision}, chunks of {chunk}: |Δ log p| prefill {prefill:.1e}, decode {decode:.1e}")
    assert prefill < 2e-2 and decode < 2e-2
    assert served == tokens, "greedy text differs from generate cache.backend=packed"


PLAIN = """
import json, sys, vllm
from vllm import SamplingParams
from quantmla.errors import QuantMLAError
export, ids = sys.argv[1], json.loads(sys.argv[2])
try:
    vllm.LLM(model=export, dtype="float32", kv_cache_memory_bytes=1 << 20)
    refusal = None
except QuantMLAError as error:
    refusal = str(error)
llm = vllm.LLM(model=export, dtype="float32", kv_cache_memory_bytes=64 << 20)
config = llm.llm_engine.vllm_config
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=64, temperature=0.0))
print("RESULT " + json.dumps({
    "refusal": refusal, "tokens": list(out[0].outputs[0].token_ids),
    "chunked": config.scheduler_config.enable_chunked_prefill,
    "batched": config.scheduler_config.max_num_batched_tokens,
    "prefix": config.cache_config.enable_prefix_caching,
    "seqs": config.scheduler_config.max_num_seqs,
}))
"""


def test_plain_vllm_with_its_defaults_gives_the_packed_text(exports, prompt_ids, tmp_path):
    """No scheduler flags (fp32 weights, as the packed generate runs), vLLM's compiled mode and its worker process: chunked prefill on at
    vLLM's default batch, prefix caching off with one printed line, the default max_num_seqs
    lowered with one; a budget too small answers in this process, not as a dead worker."""
    model = exports["v2_rtn_c4r4"]
    done = subprocess.run(
        [sys.executable, "-c", PLAIN, str(model), json.dumps(prompt_ids)],
        cwd=REPO, capture_output=True, text=True, timeout=600, preexec_fn=all_cores,
        env={k: v for k, v in child_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert "kv_cache_memory_bytes=1048576" in result["refusal"]
    assert result["chunked"] and result["batched"] == 4096 and not result["prefix"]
    assert done.stderr.count(PREFIX_CACHING_OFF) >= 1
    assert f"quantmla: max_num_seqs 256 -> {result['seqs']}" in done.stderr
    packed = packed_generate(model, prompt_ids, "c4r4", 64, tmp_path)
    assert result["tokens"] == packed["token_ids"]


def test_prefix_caching_asked_for_is_refused_in_one_line(exports):
    with pytest.raises(QuantMLAError, match="without prefix caching"):
        engine_args(exports["v2_rtn_c4r4"], enable_prefix_caching=True)
    assert "prefix caching" in PREFIX_CACHING_REFUSED
