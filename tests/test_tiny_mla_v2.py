"""The second testbed's checkpoint (#13): V2 layout, loads offline, runs through every method with
fusion equivalence on its trained weights, and the retrieval evaluator (record, table, bad input)."""

import json

import pytest
import torch

from quantmla.errors import ConfigError
from quantmla.run import run
from quantmla.tracking.store import load_records
from tests.conftest import DATA_DIR, REPO, run_config

V2 = REPO / "assets" / "tiny-mla-v2"
pytestmark = pytest.mark.skipif(
    not (V2 / "config.json").is_file() or not DATA_DIR.is_dir(),
    reason="needs the second testbed and the shared data",
)

CALIBRATION = [
    "method.calibration.n_calibration=2",
    "method.calibration.n_heldout=1",
    "method.calibration.steps=2",
    "method.calibration.select_every=1",
    "method.calibration.batch_size=1",
]


def job(tmp_path, *overrides):
    return [
        "model=tiny_mla_v2",
        "model.eval_seqlen=256",
        f"paths.results_dir={tmp_path}",
        f"paths.data_dir={DATA_DIR}",
        "eval=retrieval",
        "eval.context_lengths=[256]",
        "eval.haystacks=[noise]",
        "eval.limit=2",
        "logger=none",
        *overrides,
    ]


def test_checkpoint_is_a_v2_layout_model_within_budget():
    from transformers import AutoModelForCausalLM

    from quantmla.models.adapters import DeepseekV2Adapter, get_adapter

    config = json.loads((V2 / "config.json").read_text())
    assert config["model_type"] == "deepseek_v2" and config["kv_lora_rank"] == 256
    assert config["qk_rope_head_dim"] == 64 and config["max_position_embeddings"] >= 4096
    assert (V2 / "model.safetensors").stat().st_size <= 40 * 2**20
    model = AutoModelForCausalLM.from_pretrained(V2, dtype=torch.float32)  # offline (conftest)
    assert isinstance(get_adapter(model.config), DeepseekV2Adapter)
    assert (V2 / "training_curve.csv").is_file() and (V2 / "training_curve.png").is_file()


@pytest.mark.parametrize("method", ["rtn", "smoothquant", "quarot", "quantmla"])
def test_every_method_runs_with_fusion_equivalence_on_the_trained_weights(method, tmp_path):
    overrides = job(tmp_path, "precision=c2r4", f"method={method}", "eval.compare_bf16=false")
    calibrated = method in ("smoothquant", "quantmla")
    record = run(run_config(*overrides, *(CALIBRATION if calibrated else [])))
    m = record["metrics"]
    assert 0 <= m["retrieval/noise/256"] <= 100 and m["retrieval/samples_per_length"] == 2
    if method != "rtn":  # a fused transform: equal to the unfused model with quantization off
        assert m["equivalence/max_layer_rel_error"] <= m["equivalence/tolerance"] <= 1e-4
        assert m["equivalence/nll_drift"] <= m["equivalence/tolerance"]


def test_retrieval_record_and_table(tmp_path, capsys):
    from quantmla.evaluation.retrieval import format_table

    record = run(run_config(*job(tmp_path, "precision=c4r4", "precision.sink=0")))
    m = record["metrics"]
    assert {"bf16/retrieval/noise/256", "retrieval/noise/256"} <= m.keys()
    table = format_table(record)
    assert "| noise | bf16 |" in table and "| noise | c4r4 rtn |" in table
    (stored,) = load_records(tmp_path, "default")
    assert stored["metrics"] == json.loads(json.dumps(m))


def test_retrieval_documents_are_the_same_for_every_cache():
    """Each job scores the same documents: a function of (seed, length)."""
    from transformers import AutoTokenizer

    from quantmla.evaluation.retrieval import documents, sampler_for

    tok = AutoTokenizer.from_pretrained(V2)
    sampler = sampler_for("c4", tok, DATA_DIR)
    a, b = documents(sampler, 512, 3, seed=0), documents(sampler, 512, 3, seed=0)
    assert [d.ids for d in a] == [d.ids for d in b] and all(len(d.ids) == 512 for d in a)
    assert [d.ids for d in documents(sampler, 512, 3, seed=1)] != [d.ids for d in a]


@pytest.mark.parametrize(
    "override,field",
    [
        ("eval.haystacks=[wiki]", "eval.haystacks"),
        ("eval.haystacks=[]", "eval.haystacks"),
        ("eval.context_lengths=[64]", "eval.context_lengths"),
        ("eval.context_lengths=[8192]", "eval.context_lengths"),
        ("eval.limit=0", "eval.limit"),
    ],
)
def test_bad_retrieval_config_names_the_field(override, field, tmp_path):
    from quantmla.job import resolve as validate

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(run_config(*job(tmp_path, override)))


def test_answer_token_diagnosis_agrees_with_greedy_generation():
    """A document whose every answer token is the teacher-forced argmax is a greedy hit (the greedy
    path is the teacher path); position 0 counts first-token argmax hits (recomputed here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.evaluation.retrieval import accuracy, answer_token_hits, documents, sampler_for

    tok = AutoTokenizer.from_pretrained(V2)
    model = AutoModelForCausalLM.from_pretrained(V2, dtype=torch.float32).eval()
    docs = documents(sampler_for("noise", tok, DATA_DIR), 256, 6, seed=3)
    hits, totals, whole = answer_token_hits(model, docs)
    assert totals[0] == 6 and totals == sorted(totals, reverse=True)
    with torch.no_grad():
        first = sum(
            int(model(input_ids=torch.tensor([d.ids[: d.prompt_len]])).logits[0, -1].argmax())
            == d.ids[d.prompt_len]
            for d in docs
        )
    assert hits[0] == first
    assert whole <= round(accuracy(model, tok, docs, max_new_tokens=12) * 6)
