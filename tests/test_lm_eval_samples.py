"""quantmla/evaluation/lm_eval/samples.py: per-document scores from lm-eval's logged samples."""

from quantmla.evaluation.lm_eval.samples import document_scores, trim


def _example(doc_id, acc, acc_norm, filt="none"):
    return {"doc_id": doc_id, "doc": {"q": "..."}, "arguments": [["ctx", " a"]], "resps": [[-1.0]],
            "filter": filt, "metrics": ["acc", "acc_norm"], "acc": acc, "acc_norm": acc_norm}  # fmt: skip


def test_scores_follow_doc_id_the_metric_and_its_filter():
    samples = trim({"piqa": [_example(1, 1.0, 0.0), _example(0, 0.0, 1.0), _example(0, 1, 1, "x")]})
    assert samples["piqa"][0] == {"doc_id": 1, "filter": "none", "acc": 1.0, "acc_norm": 0.0}
    assert trim(samples) == samples  # the vLLM worker's trimmed samples pass through unchanged
    assert document_scores(samples, ["piqa"], "acc,none") == [0.0, 1.0]
    assert document_scores(samples, ["piqa"], "acc_norm,none") == [1.0, 0.0]
    assert document_scores(samples, ["piqa"], "acc,x") == [1.0]


def test_a_group_lists_its_members_in_order_and_unlogged_scores_are_none():
    samples = trim({"b": [_example(0, 1.0, 1.0)], "a": [_example(1, 0.0, 0.0), _example(0, 1, 0)]})
    assert document_scores(samples, ["group", "b", "a"], "acc,none") == [1.0, 1.0, 0.0]
    assert document_scores(samples, ["group"], "acc,none") is None
    assert document_scores(samples, ["b"], "exact_match,none") is None
