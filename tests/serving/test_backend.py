"""The QuantMLA vLLM backend against independent references: transformers' fp32 model (BF16
mode), the simulator's teacher-forced log-probs and `quantmla.generate cache.backend=packed`'s
greedy text (C4R4 with protection), the memory model's capacity, and one-line refusals."""

import gc
import json
import sys

import pytest

from quantmla.errors import ConfigError, DataNotFoundError, QuantMLAError
from quantmla.serving.engine import build_llm, capacity_tokens, expected_capacity
from quantmla.serving.settings import ServeSettings, resolve_settings
from tests.serving.conftest import (
    REPO,
    WIKITEXT,
    export,
    packed_generate,
    project,
    reference_logprobs,
)

BUDGET = 64_000_000


@pytest.fixture(scope="module")
def engines(exports):
    """BF16 mode and C4R4 (fp32 protection rows, so only float order differs from the simulator)."""
    model = exports["v2_rtn_c4r4"]
    made = {}

    def get(name):
        if name not in made:
            for other in list(made):  # one engine at a time
                del made[other]
            gc.collect()
            kw = {
                "bf16": {"precision": "bf16"},
                "c4r4": {"quantmla": {"protection_dtype": "float32"}},
            }
            made[name] = build_llm(
                model, dtype="float32", kv_cache_memory_bytes=BUDGET, max_num_seqs=8,
                max_model_len=2048, **kw[name],
            )  # fmt: skip
        return made[name]

    yield get
    made.clear()
    gc.collect()


def prompt_logprobs(llm, ids):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    lps = out[0].prompt_logprobs
    return [None] + [lps[t][ids[t]].logprob for t in range(1, len(ids))]


def greedy(llm, ids, n):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def test_bf16_mode_prompt_logprobs_equal_transformers_fp32(engines, exports, prompt_ids, tmp_path):
    llm = engines("bf16")
    got = prompt_logprobs(llm, prompt_ids)
    want = reference_logprobs(exports["v2_rtn_c4r4"], prompt_ids, "bf16", tmp_path)
    worst = max(abs(g - w) for g, w in zip(got[1:], want[1:]))
    print(f"BF16 mode vs transformers fp32: max |Δ log p| = {worst:.2e} nats over {len(got) - 1}")
    assert worst < 1e-2  # the BF16 rows' rounding of an fp32 model


def test_c4r4_decode_equals_the_simulator_and_the_packed_generate(
    engines, exports, prompt_ids, tmp_path
):
    llm = engines("c4r4")
    tokens, lps = greedy(llm, prompt_ids, 64)
    sim = reference_logprobs(exports["v2_rtn_c4r4"], prompt_ids + tokens, "c4r4", tmp_path)
    decode_part = sim[len(prompt_ids) :]
    worst = max(abs(g - w) for g, w in zip(lps, decode_part))
    print(f"C4R4 decode vs simulator (teacher-forced): max |Δ log p| = {worst:.2e} nats")
    assert worst < 2e-2
    prefill = prompt_logprobs(llm, prompt_ids)  # the quantized-history prefill path
    worst_prefill = max(abs(g - w) for g, w in zip(prefill[1:], sim[1 : len(prompt_ids)]))
    print(f"C4R4 prefill vs simulator: max |Δ log p| = {worst_prefill:.2e} nats")
    assert worst_prefill < 2e-2

    packed = packed_generate(exports["v2_rtn_c4r4"], prompt_ids, "c4r4", 64, tmp_path)
    same = next((i for i, (a, b) in enumerate(zip(tokens, packed["token_ids"])) if a != b), None)
    if same is not None:  # only at a measured near-tie of the simulator's top two
        pytest.fail(f"greedy text differs from generate cache.backend=packed at token {same}")


@pytest.mark.parametrize("mode", ["bf16", "c4r4"])
def test_capacity_equals_the_memory_model(engines, exports, mode):
    llm = engines(mode)
    model = exports["v2_rtn_c4r4"]
    extra = {"precision": "bf16"} if mode == "bf16" else {"protection_dtype": "float32"}
    settings = resolve_settings(model, extra)
    want = expected_capacity(model, settings, BUDGET, max_num_seqs=8)
    print(f"{mode}: vLLM holds {capacity_tokens(llm)} tokens, the memory model predicts {want}")
    assert abs(capacity_tokens(llm) - want) <= 16  # one page per layer


def test_refusals_are_one_line_before_vllm_starts(exports, tmp_path):
    model = exports["v2_rtn_c4r4"]
    no_manifest = tmp_path / "plain"
    no_manifest.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (no_manifest / name).symlink_to(model / name)
    with pytest.raises(DataNotFoundError, match="no quantmla.json"):
        build_llm(no_manifest)
    assert resolve_settings(no_manifest, {"precision": "c4r4"}).precision == "c4r4"  # stated: RTN
    with pytest.raises(ConfigError, match="precision.*c5r4.*bits in"):
        build_llm(model, precision="c5r4")
    with pytest.raises(QuantMLAError, match="kv_cache_memory_bytes=100000 cannot hold one"):
        build_llm(model, kv_cache_memory_bytes=100_000)
    from quantmla.serving import serve

    with pytest.raises(SystemExit, match="kv_cache_memory_bytes=1000 cannot hold one"):
        serve.main([str(model), "--kv-cache-memory-bytes", "1000"])  # vLLM's default max_num_seqs
    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((model / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 128}))
    with pytest.raises(ConfigError, match="kv_lora_rank \\+ qk_rope_head_dim='128 \\+ 64 = 192'"):
        build_llm(wide)
    with pytest.raises(ConfigError, match="additional_config.quantmla"):
        build_llm(model, quantmla={"recnet": 64})


def test_settings_follow_the_manifest(exports):
    s = resolve_settings(exports["v2_rtn_c4r4"], None)
    assert s == ServeSettings(precision="c4r4")
    assert s.token_bytes(256, 64) == 184 and s.protection_bytes(256, 64) == 132 * 320 * 2


def test_lm_eval_on_vllm_scores_like_the_hf_engine(tmp_path):
    """eval.engine=vllm (lm-eval's own vllm model on the job's export, this backend) against the
    default hf engine (HFLM over the simulator), same job otherwise: ARC-E and PIQA, 20 docs each."""
    scores = {}
    for engine in ("hf", "vllm"):
        project(
            "-m", "quantmla.run", "model=tiny_mla_v2", "precision=c4r4", "method=rtn",
            "eval=tiny_table1_mc", "eval.tasks=[arc_easy,piqa]", "eval.limit=20",
            f"eval.engine={engine}", "logger=none", f"paths.results_dir={tmp_path}",
            f"paths.serve_python={sys.executable}",
        )  # fmt: skip
        [record] = [
            json.loads(p.read_text())
            for p in tmp_path.glob("default/*/result.json")
            if json.loads(p.read_text())["config"]["eval"]["engine"] == engine
        ]
        scores[engine] = {t: record["metrics"][f"acc/{t}"] for t in ("arc_easy", "piqa")}
        for t in ("arc_easy", "piqa"):  # the worker's trimmed samples: each document's score
            docs = record["metrics"][f"docs/{t}"]
            assert len(docs) == 20 and 100 * sum(docs) / 20 == pytest.approx(scores[engine][t])
    print(f"hf {scores['hf']} vs vllm {scores['vllm']}")
    for task in ("arc_easy", "piqa"):  # one document is 5 points: allow one near-tie flip
        assert abs(scores["hf"][task] - scores["vllm"][task]) <= 5.0 + 1e-9


SMOL = REPO / "checkpoints" / "smol-mla"


@pytest.mark.slow
def test_smol_mla_c4r4_greedy_equals_the_packed_generate(tmp_path):
    """The real-weights testbed (issue #39; `make testbed-smol` first): vLLM with the plug-in continues
    a 700-token WikiText-2 prompt with `quantmla.generate cache.backend=packed`'s greedy text."""
    from transformers import AutoTokenizer

    if not (SMOL / "config.json").is_file():
        pytest.skip(f"build the testbed first ({SMOL}: make testbed-smol)")
    model = export(tmp_path / "smol_c4r4", "model=smol_mla", "method=rtn", "precision=c4r4")
    ids = AutoTokenizer.from_pretrained(model)(WIKITEXT.read_text()[1000:6000]).input_ids[:700]
    assert len(ids) == 700
    llm = build_llm(
        model, dtype="float32", kv_cache_memory_bytes=BUDGET, max_num_seqs=4, max_model_len=2048,
        quantmla={"protection_dtype": "float32"},
    )  # fmt: skip
    tokens, _ = greedy(llm, ids, 48)
    packed = packed_generate(model, ids, "c4r4", 48, tmp_path)
    assert tokens == packed["token_ids"]
