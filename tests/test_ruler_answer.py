"""RULER answers teacher-forced (eval=ruler_answer): a job's per-sample log-likelihoods against the
full forward's float64 log-softmax over the prepared model, read through the quantized cache."""

import pytest
import torch

from tests.conftest import DATA_DIR, needs_tiny, run_config


def _overrides(tmp_path, *extra):
    return [
        f"paths.results_dir={tmp_path}", f"paths.data_dir={DATA_DIR}", "model=tiny_mla",
        "eval=ruler_answer", "eval.tasks=[s_niah_1,s_niah_3]", "eval.context_lengths=[512]",
        "eval.limit=2", "precision=c2r4", "method=rtn", "logger=none", *extra,
    ]  # fmt: skip


@needs_tiny
def test_record_equals_the_full_forward_over_prompt_and_answer(tmp_path):
    from quantmla.evaluation.lm_eval.niah import generate
    from quantmla.evaluation.ruler_answer import answer_ids
    from quantmla.job import resolve
    from quantmla.prepare import prepare
    from quantmla.run import run

    record = run(run_config(*_overrides(tmp_path)))
    m = record["metrics"]
    cfg = run_config(*_overrides(tmp_path))
    prepared = prepare(resolve(cfg))
    samples = generate("niah_single_3", 512, prepared.tokenizer, DATA_DIR, 2, cfg.seed)

    def reference(prompt, answer):
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logits = prepared.model(ids).logits[0].double()
        rows = logits[len(prompt) - 1 : -1]
        logp = torch.log_softmax(rows, -1)[torch.arange(len(answer)), answer]
        return float(logp.sum()), bool((rows.argmax(-1) == torch.tensor(answer)).all())

    expected = [reference(*answer_ids(prepared.tokenizer, s)) for s in samples]
    lead = prepared.tokenizer(":", add_special_tokens=False).input_ids
    prompt, answer = answer_ids(prepared.tokenizer, samples[0])
    assert (
        prompt[-len(lead) :] == lead
        and prepared.tokenizer.decode(answer).strip() == (samples[0]["outputs"][0])
    )
    with prepared.unquantized():
        unquantized = [reference(*answer_ids(prepared.tokenizer, s))[0] for s in samples]
    assert m["docs/ruler_answer/s_niah_3/512/loglik"] == pytest.approx(
        [e[0] for e in expected], rel=1e-5
    )
    assert m["docs/ruler_answer/s_niah_3/512/exact"] == [float(e[1]) for e in expected]
    assert m["ruler_answer/s_niah_3/avg/loglik"] == pytest.approx(sum(e[0] for e in expected) / 2)
    # the answer reads the C2R4 cache: not the unquantized model's likelihood
    assert all(abs(a - e[0]) > 1e-4 for a, e in zip(unquantized, expected))
    assert set(m) >= {"ruler_answer/s_niah_1/512/exact", "ruler_answer/samples_per_length"}


@needs_tiny
@pytest.mark.parametrize(
    "extra, match",
    [
        (["eval.tasks=[s_niah_4]"], "eval.tasks.*s_niah_4.*s_niah_1"),
        (["eval.context_lengths=[4096]"], "max_position_embeddings \\(2048\\)"),
        (["eval.limit=null"], "eval.limit"),
    ],
)
def test_bad_input_names_the_field(tmp_path, extra, match):
    from quantmla.errors import QuantMLAError
    from quantmla.job import resolve

    with pytest.raises(QuantMLAError, match=match):
        resolve(run_config(*_overrides(tmp_path, *extra)))
