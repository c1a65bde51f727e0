"""analysis/claims.py: each claim's verdict from records, on synthetic stores with known answers."""

import numpy as np

from analysis.claims import _missing, claims_rows


def table1(ppl: dict[tuple[str, str], float], experiment="smol_table1") -> list[dict]:
    return [
        {"experiment": experiment,
         "config": {"model": {"name": "smol_mla"}, "precision": {"name": p}, "method": {"name": m}},
         "metrics": {"ppl/wikitext2": v}}
        for (p, m), v in ppl.items()
    ]  # fmt: skip


def smol_column(rows, claim_start: str) -> tuple[str, str]:
    (row,) = [r for r in rows if r[0].startswith(claim_start)]
    return row[4], row[5]


def test_table1_claims_follow_the_perplexities():
    ppl = {("bf16", "rtn"): 20.0, ("c4r4", "quantmla"): 20.1, ("c2r4", "rtn"): 30.0,
           ("c2r4", "smoothquant"): 25.0, ("c2r4", "quarot"): 22.0, ("c2r4", "quantmla"): 21.0}  # fmt: skip
    rows = claims_rows(table1(ppl))
    assert smol_column(rows, "C4R4 QuantMLA") == ("+0.50 % ppl", "yes")
    assert smol_column(rows, "C2R4 QuantMLA") == ("+5.00 % vs QuaRot† +10.00 %", "yes")
    assert smol_column(rows, "Ranking")[1] == "yes"
    ppl[("c2r4", "quantmla")] = 23.0  # now between QuaRot† and SmoothQuant†
    ppl[("c4r4", "quantmla")] = 20.4
    rows = claims_rows(table1(ppl))
    assert smol_column(rows, "C4R4 QuantMLA") == ("+2.00 % ppl", "**no**: more than 1 % from BF16")
    assert smol_column(rows, "C2R4 QuantMLA")[1] == "**no**: QuaRot† is lower"
    ppl[("c2r4", "quantmla")] = 22.01  # 0.05 % above QuaRot†: inside the rounding spread
    assert smol_column(claims_rows(table1(ppl)), "C2R4 QuantMLA")[1] == (
        "**no**: not separated: within the 0.1 % rounding spread"
    )
    ppl[("c2r4", "quantmla")] = 23.0
    value, verdict = smol_column(rows, "Ranking")
    assert value == "RTN < SmoothQuant† < QuantMLA < QuaRot†" and verdict.startswith("**no**")


def test_claims_without_records_say_what_would_give_them():
    rows = claims_rows(table1({("bf16", "rtn"): 20.0}, experiment="elsewhere"))
    value, verdict = smol_column(rows, "C4R4 QuantMLA")
    assert value == "—" and "experiment=smol_table1" in verdict
    assert smol_column(rows, "Cache-pressure")[1] == (
        "—: no records: `python -m quantmla.run experiment=smol_fig5c_throughput`"
    )
    assert _missing("smol_nothing").reason == "no records; no `smol_nothing` experiment yet"
    rows = claims_rows(table1({("bf16", "rtn"): 20.0, ("c2r4", "rtn"): 30.0}))
    assert smol_column(rows, "C4R4 QuantMLA")[1] == (
        "—: no records of QuantMLA C4R4: `python -m quantmla.run experiment=smol_table1 "
        "precision=c4r4 method=quantmla`"
    )
    assert smol_column(rows, "Ranking")[1] == (
        "—: no records of SmoothQuant† C2R4, QuaRot† C2R4, QuantMLA C2R4: `python -m quantmla.run "
        "experiment=smol_table1 precision=c2r4 method=smoothquant,quarot,quantmla`"
    )


def test_a_swapped_ranking_names_the_path_that_swaps_it():
    ppl = {("bf16", "rtn"): 20.0, ("c2r4", "rtn"): 30.0, ("c2r4", "smoothquant"): 23.6,
           ("c2r4", "quarot"): 24.4, ("c2r4", "quantmla"): 21.0}  # fmt: skip
    rows = claims_rows(table1(ppl))
    assert smol_column(rows, "Ranking")[1] == (
        "**no**: a different order; per path: no `c2r16` records for SmoothQuant† and QuaRot†"
    )
    split = {("c2r16", "smoothquant"): 22.0, ("c2r16", "quarot"): 23.5,
             ("c16r4", "smoothquant"): 20.6, ("c16r4", "quarot"): 20.5}  # fmt: skip
    rows = claims_rows(table1(ppl) + table1(split, experiment="smol_path_split"))
    assert smol_column(rows, "Ranking")[1] == (
        "**no**: a different order; content alone (C2R16) SmoothQuant† 22.00 vs QuaRot† 23.50; "
        "RoPE alone (C16R4) SmoothQuant† 20.60 vs QuaRot† 20.50 (ppl): content alone puts "
        "SmoothQuant† ahead"
    )
    split[("c2r16", "smoothquant")] = 24.0  # now neither path alone
    rows = claims_rows(table1(ppl) + table1(split, experiment="smol_path_split"))
    assert smol_column(rows, "Ranking")[1].endswith("neither path alone puts SmoothQuant† ahead")


TASKS = ("hellaswag_10shot", "piqa_5shot", "arc_easy_25shot", "arc_challenge_25shot",
         "winogrande_5shot")  # fmt: skip


def fewshot(acc: dict[tuple[str, str], float], stderr: float = 2.0) -> list[dict]:
    tasks = TASKS
    return [
        {"experiment": "smol_table1",
         "config": {"model": {"name": "smol_mla"}, "precision": {"name": p}, "method": {"name": m}},
         "metrics": {**{f"acc/{t}": v for t in tasks}, **{f"acc_stderr/{t}": stderr for t in tasks}}}
        for (p, m), v in acc.items()
    ]  # fmt: skip


def test_accuracy_claims_weigh_the_difference_by_its_standard_error():
    # five tasks of stderr 2: an average's SE 2 / √5 = 0.894, a difference's 1.265
    acc = {("bf16", "rtn"): 50.0, ("c4r4", "quantmla"): 48.0, ("c2r4", "rtn"): 40.0,
           ("c2r4", "smoothquant"): 44.0, ("c2r4", "quarot"): 43.0, ("c2r4", "quantmla"): 47.0}  # fmt: skip
    rows = claims_rows(fewshot(acc))
    assert smol_column(rows, "In accuracy, C4R4") == (
        "-2.0 ± 1.3 points (48.0 vs 50.0)",
        "yes",
    )
    assert smol_column(rows, "In accuracy, C2R4") == (
        "+3.0 ± 1.3 points vs SmoothQuant† (47.0 vs 44.0)",
        "yes",
    )
    acc[("c4r4", "quantmla")], acc[("c2r4", "quantmla")] = 47.0, 45.0
    rows = claims_rows(fewshot(acc))
    assert smol_column(rows, "In accuracy, C4R4")[1] == ("**no**: 2.4 standard errors from BF16")
    assert smol_column(rows, "In accuracy, C2R4")[1] == (
        "**no**: ahead by 0.8 standard errors: not separated (the average resolves 2.5 points here)"
    )
    ppl = {("bf16", "rtn"): 20.0, ("c2r4", "rtn"): 30.0}  # RTN's perplexity cost beside its points
    rows = claims_rows(fewshot(acc) + table1(ppl))
    assert smol_column(rows, "In accuracy, C2R4")[1].endswith(
        "(the average resolves 2.5 points here; RTN C2R4, +50.0 % ppl, is -10.0 ± 1.3 from BF16)"
    )
    value, verdict = smol_column(
        claims_rows(fewshot({("c2r4", "quantmla"): 51.0})),
        "In accuracy, C2R4",
    )
    assert value == "—" and "eval=commonsense_fewshot eval.limit=100" in verdict


def test_records_with_per_document_scores_are_compared_paired():
    """Two cells scoring the same documents: the difference's standard error from the per-document
    differences (float64 reference below), far below the independent bound when they agree."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2, size=(5, 100)).astype(float)  # QuaRot†: 5 tasks × 100 documents
    ours = base.copy()
    ours[:, :6] = 1.0  # agrees on 94 of each task's documents, gains where it differs
    records = fewshot({("bf16", "rtn"): 60.0, ("c2r4", "rtn"): 40.0, ("c2r4", "smoothquant"): 41.0,
                       ("c2r4", "quarot"): 100 * base.mean(), ("c2r4", "quantmla"): 100 * ours.mean()},
                      stderr=5.0)  # fmt: skip
    for r in records:
        method = r["config"]["method"]["name"]
        if method in ("quarot", "quantmla"):
            scores = ours if method == "quantmla" else base
            r["metrics"].update({f"docs/{t}": list(row) for t, row in zip(TASKS, scores)})
            r["metrics"].update({f"acc/{t}": 100 * row.mean() for t, row in zip(TASKS, scores)})
    diff = 100 * (ours - base)
    se = np.sqrt(sum(d.var(ddof=1) / d.size for d in diff)) / 5
    value, verdict = smol_column(claims_rows(records), "In accuracy, C2R4")
    assert value.startswith(f"{diff.mean():+.1f} ± {se:.1f} paired points vs QuaRot†")
    assert se < np.hypot(5.0, 5.0) / np.sqrt(5) / 3  # a third of the independent bound
    assert diff.mean() > 1.96 * se and verdict == "yes"  # independently: 3.8 ± 3.2, not separated


def test_accuracy_claims_are_not_read_where_bf16_scores_at_chance():
    # chance of the five tasks: (25 + 50 + 25 + 25 + 50) / 5 = 35; BF16 36.0 ± 0.9 is within 1.96 SE
    acc = {("bf16", "rtn"): 36.0, ("c4r4", "quantmla"): 36.0, ("c2r4", "rtn"): 33.0,
           ("c2r4", "smoothquant"): 34.0, ("c2r4", "quarot"): 34.0, ("c2r4", "quantmla"): 38.0}  # fmt: skip
    rows = claims_rows(fewshot(acc))
    for claim in ("In accuracy, C4R4", "In accuracy, C2R4"):
        assert (
            smol_column(rows, claim)[1]
            == "—: BF16 at chance (36.0 ± 0.9 vs 35): not measurable here"
        )
    only_bf16 = claims_rows(fewshot({("bf16", "rtn"): 36.0}))  # the quantized cells are not needed
    assert smol_column(only_bf16, "In accuracy, C2R4") == (
        "—",
        "—: BF16 at chance (36.0 ± 0.9 vs 35): not measurable here",
    )
    acc[("bf16", "rtn")] = 37.0  # 2.2 SE above chance: read as usual
    rows = claims_rows(fewshot(acc))
    assert smol_column(rows, "In accuracy, C4R4") == ("-1.0 ± 1.3 points (36.0 vs 37.0)", "yes")
    assert smol_column(rows, "In accuracy, C2R4")[1] == "yes"


def test_a_ranking_shows_perplexities_within_the_rounding_spread_as_one_group():
    ppl = {("bf16", "rtn"): 300.0, ("c2r4", "rtn"): 310.0, ("c2r4", "smoothquant"): 308.222,
           ("c2r4", "quarot"): 309.0, ("c2r4", "quantmla"): 308.242}  # fmt: skip
    value, verdict = smol_column(claims_rows(table1(ppl)), "Ranking")
    assert value == "RTN < QuaRot† < {QuantMLA, SmoothQuant†}"
    assert verdict.startswith("**no**: a different order")
    ppl[("c2r4", "smoothquant")], ppl[("c2r4", "quarot")] = 309.5, 308.3  # paper's order, a tie
    value, verdict = smol_column(claims_rows(table1(ppl)), "Ranking")
    assert (value, verdict) == ("RTN < SmoothQuant† < {QuaRot†, QuantMLA}", "**no**: not separated")


def probes_record(permutation: float, a_content: float, o_content: float) -> dict:
    """One SmolLM2-MLA probe cell of two layers: every draw's gain ratio given, A_C and O_C."""
    draws = lambda v: [[v, v], [v, v]]  # noqa: E731  # (layer, draw)
    return {
        "experiment": "smol_table5_probes",
        "config": {"model": {"name": "smol_mla"}, "precision": {"name": "c4r4"},
                   "method": {"name": "rtn"}, "eval": {"datasets": ["wikitext2"]}, "seed": 0},
        "metrics": {
            "probes/G_content": [1.0, 1.0], "probes/G_rope": [2.0, 2.0], "probes/layers": [0, 1],
            "probes/ratio_signs": draws(1.0), "probes/ratio_permutation": draws(permutation),
            "probes/ratio_isotropic": draws(1 / (a_content + o_content)),
            "probes/observations": [[[0, 0, g, g] for g in (1.0, 2.0, 3.0)]] * 2,
            "probes/A_content": [a_content] * 2, "probes/O_content": [o_content] * 2,
        },
    }  # fmt: skip


def test_a_permutation_gain_is_explained_by_a_c_plus_o_c_either_way():
    claim = "Whole-token permutation"
    value, verdict = smol_column(claims_rows([probes_record(2.5, 0.3, 0.0)]), claim)
    assert value == "median 2.50x; 2.50x at layer 1"  # no layer 20: the middle one
    assert verdict == (
        "yes: G = T(A + O): 1/(A_C + O_C) = 3.33x (A_C median 0.300, O_C +0.000; measured "
        "isotropic 3.33x)"
    )
    value, verdict = smol_column(claims_rows([probes_record(0.9, 1.0, 1.0)]), claim)
    assert value == "median 0.90x; 0.90x at layer 1"
    assert verdict == (
        "**no**: permutation does not raise the gain: G = T(A + O) predicts an even spread of the "
        "content error at 1/(A_C + O_C) = 0.50x its gain (A_C median 1.000, O_C +1.000; measured "
        "isotropic 0.50x): the paper's rise needs A_C + O_C well below 1"
    )


def ruler(cells: dict[tuple[str, str], np.ndarray], n: int) -> list[dict]:
    """RULER records: each cell's (3 tasks, 2 lengths, n samples) scores of 0 / 1, kept per sample."""
    records = []
    for (p, m), scores in cells.items():
        metrics = {"ruler/samples_per_length": n}
        for task, per_length in zip(("s_niah_1", "s_niah_2", "s_niah_3"), scores):
            for length, docs in zip((1024, 2048), per_length):
                metrics[f"ruler/{task}/{length}"] = 100 * docs.mean()
                metrics[f"docs/ruler/{task}/{length}"] = list(docs)
            metrics[f"ruler/{task}/avg"] = 100 * per_length.mean()
        config = {"model": {"name": "smol_mla"}, "precision": {"name": p}, "method": {"name": m}}
        records.append({"experiment": "smol_fig4_ruler", "config": config, "metrics": metrics})
    return records


def test_retrieval_is_compared_paired_per_sample_and_a_task_bf16_cannot_do_is_left_out():
    rng = np.random.default_rng(1)
    bf16 = (rng.random((3, 2, 40)) < 0.9).astype(float)
    bf16[2] = 0.0  # S-NIAH-3: BF16 retrieves nothing
    ours = bf16.copy()
    ours[0, :, :2] = 0.0  # S-NIAH-1: a few samples lost, within 5 points
    rows = claims_rows(ruler({("bf16", "rtn"): bf16, ("c4r4", "quantmla"): ours}, 40))
    value, verdict = smol_column(rows, "RULER")
    assert value.startswith(f"{100 * ours[0].mean():.1f} / ") and "(BF16 " in value
    assert verdict == "yes: BF16 cannot retrieve S-NIAH-3"
    ours[1, :, :8] = 0.0  # S-NIAH-2 loses up to 8 of 40 samples a length: beyond 5 points
    lost = 100 * (bf16[1] - ours[1])  # float64 reference of the paired standard error
    se = np.sqrt(sum(d.var(ddof=1) / d.size for d in lost)) / 2
    rows = claims_rows(ruler({("bf16", "rtn"): bf16, ("c4r4", "quantmla"): ours}, 40))
    assert smol_column(rows, "RULER")[1] == (
        f"**no**: S-NIAH-2 {lost.mean():.1f} ± {se:.1f} paired points below BF16"
        + (": not separated from the 5-point margin" if lost.mean() - 1.96 * se <= 5 else "")
        + "; BF16 cannot retrieve S-NIAH-3"
    )
    rtn = bf16.copy()
    rtn[:2, :, :12] = 0.0  # RTN loses more on both tasks BF16 reads
    with_rtn = ruler({("bf16", "rtn"): bf16, ("c4r4", "quantmla"): ours, ("c4r4", "rtn"): rtn}, 40)
    rtn_lost = [100 * (bf16[t] - rtn[t]) for t in (0, 1)]
    rtn_se = [np.sqrt(sum(d.var(ddof=1) / d.size for d in x)) / 2 for x in rtn_lost]
    assert smol_column(claims_rows(with_rtn), "RULER")[1].endswith(
        f"; RTN C4R4 {100 * rtn[0].mean():.1f} / {100 * rtn[1].mean():.1f}, "
        f"{-rtn_lost[0].mean():+.1f} ± {rtn_se[0]:.1f} / {-rtn_lost[1].mean():+.1f} ± "
        f"{rtn_se[1]:.1f} paired points vs BF16 on S-NIAH-1 / S-NIAH-2; BF16 cannot retrieve "
        "S-NIAH-3"
    )
    wider = bf16.copy()
    wider[1, 0, :1] = 0.0  # one S-NIAH-2 sample lost: by hand 1.25 ± sqrt(250 / 40) / 2 = 1.25
    with_rtn += ruler({("c4r8", "quantmla"): wider}, 40)
    scores = f"{100 * wider[0].mean():.1f} / {100 * wider[1].mean():.1f}"
    assert smol_column(claims_rows(with_rtn), "RULER")[1].endswith(
        f"S-NIAH-1 / S-NIAH-2; QuantMLA C4R8 (an INT8 RoPE key) {scores}, +0.0 ± 0.0 / -1.2 ± 1.2 "
        "paired points vs BF16 on S-NIAH-1 / S-NIAH-2: within 5 points on each; BF16 cannot "
        "retrieve S-NIAH-3"
    )
    wider[0, :, :8] = 0.0  # S-NIAH-1 loses up to 8 of 40 a length: beyond the margin
    with_rtn[-1:] = ruler({("c4r8", "quantmla"): wider}, 40)
    beyond = smol_column(claims_rows(with_rtn), "RULER")[1]
    assert f"(an INT8 RoPE key) {100 * wider[0].mean():.1f} / " in beyond
    assert "on each" not in beyond
    records = ruler({("bf16", "rtn"): bf16, ("c4r4", "quantmla"): ours}, 40)
    for r in records:  # without per-sample scores: two independent proportions' bound
        r["metrics"] = {k: v for k, v in r["metrics"].items() if not k.startswith("docs/")}
    p, q = 100 * bf16[1].mean(axis=1), 100 * ours[1].mean(axis=1)
    independent = np.sqrt(sum(p * (100 - p) + q * (100 - q)) / 40) / 2
    assert (
        f"{lost.mean():.1f} ± {independent:.1f} points below"
        in smol_column(claims_rows(records), "RULER")[1]
    )
    assert independent > se
    only_bf16 = claims_rows(ruler({("bf16", "rtn"): bf16}, 40))
    assert smol_column(only_bf16, "RULER")[1] == (
        "—: no records of QuantMLA C4R4: `python -m quantmla.run experiment=smol_fig4_ruler "
        "precision=c4r4 method=quantmla`"
    )
    blind = ruler({("bf16", "rtn"): 0 * bf16, ("c4r4", "quantmla"): 0 * ours}, 40)
    assert smol_column(claims_rows(blind), "RULER")[1] == (
        "—: BF16 cannot retrieve S-NIAH-1, S-NIAH-2, S-NIAH-3: not measurable here"
    )


def answers(cells: dict[tuple[str, str], list[float]]) -> list[dict]:
    """eval=ruler_answer records: each cell's S-NIAH-3 answer log-likelihoods at one length."""
    records = []
    for (p, m), loglik in cells.items():
        config = {"model": {"name": "smol_mla"}, "precision": {"name": p}, "method": {"name": m},
                  "eval": {"kind": "ruler_answer", "tasks": ["s_niah_3"], "context_lengths": [1024]}}  # fmt: skip
        metrics = {"docs/ruler_answer/s_niah_3/1024/loglik": loglik,
                   "docs/ruler_answer/s_niah_3/1024/exact": [float(x > -2.5) for x in loglik],
                   "cache/bytes_per_token": {"c4r4": 320.0, "c4r8": 352.0}.get(p, 0.0)}  # fmt: skip
        records.append({"experiment": "smol_ruler_answer", "config": config, "metrics": metrics})
    return records


def test_a_lost_retrieval_names_the_path_whose_cache_lowers_the_answers_likelihood():
    bf16 = np.ones((3, 2, 40))
    ours = bf16.copy()
    ours[2, :, :8] = 0.0  # S-NIAH-3: beyond the 5-point margin
    retrieval = ruler({("bf16", "rtn"): bf16, ("c4r4", "quantmla"): ours}, 40)
    base = [-1.0, -2.0, -3.0, -4.0]
    cells = {("bf16", "rtn"): base, ("c4r4", "rtn"): [-3.0, -4.0, -5.0, -6.0],
             ("c4r4", "quantmla"): [-2.0, -4.0, -3.0, -6.0],
             ("c4r16", "quantmla"): [-1.0, -2.0, -3.5, -4.0], ("c16r4", "quantmla"): [-2.0, -3.0, -3.0, -6.0]}  # fmt: skip

    def change(cell):
        d = np.subtract(cells[cell], base)  # float64 reference of the paired mean and its s.e.
        return f"{d.mean():+.3f} ± {d.std(ddof=1) / 2:.3f}"

    verdict = smol_column(claims_rows(retrieval + answers(cells)), "RULER")[1]
    assert verdict.endswith(
        f"; S-NIAH-3's answer teacher-forced, nats vs BF16: RTN C4R4 {change(('c4r4', 'rtn'))}, "
        f"QuantMLA C4R4 {change(('c4r4', 'quantmla'))}, its INT4 latent alone (C4R16) "
        f"{change(('c4r16', 'quantmla'))}, its INT4 RoPE key alone (C16R4) "
        f"{change(('c16r4', 'quantmla'))}: the RoPE key carries the loss"
    )
    cells[("c4r16", "quantmla")], cells[("c16r4", "quantmla")] = cells[("c16r4", "quantmla")], base
    verdict = smol_column(claims_rows(retrieval + answers(cells)), "RULER")[1]
    assert verdict.endswith(": the latent carries the loss")
    del cells[("c16r4", "quantmla")]  # one path alone: no attribution
    verdict = smol_column(claims_rows(retrieval + answers(cells)), "RULER")[1]
    assert verdict.endswith(f"(C4R16) {change(('c4r16', 'quantmla'))}")


def test_a_lost_retrieval_reports_quantmla_with_an_int8_rope_key_beside_c4r4():
    bf16 = np.ones((3, 2, 40))
    ours = bf16.copy()
    ours[2, :, :8] = 0.0
    retrieval = ruler({("bf16", "rtn"): bf16, ("c4r4", "quantmla"): ours}, 40)
    base = [-1.0, -2.0, -3.0, -4.0]  # copied (> -2.5 nats in `answers`): 2 of 4
    cells = {("bf16", "rtn"): base, ("c4r4", "quantmla"): [-2.0, -4.0, -3.0, -6.0],
             ("c4r8", "quantmla"): [-1.5, -3.0, -3.0, -4.5]}  # fmt: skip
    verdict = smol_column(claims_rows(retrieval + answers(cells)), "RULER")[1]
    d = np.array([-0.5, -1.0, 0.0, -0.5])  # float64 paired reference of mean and s.e.
    assert verdict.endswith(
        "; with an INT8 RoPE key (QuantMLA C4R8, 352 B a token vs C4R4's 320) "
        f"{d.mean():+.3f} ± {d.std(ddof=1) / 2:.3f}, copies 25.0 % (BF16 50.0 %)"
    )
    del cells[("c4r4", "quantmla")]  # nothing to weigh its bytes against: not reported
    verdict = smol_column(claims_rows(retrieval + answers(cells)), "RULER")[1]
    assert "INT8 RoPE key" not in verdict


def test_an_unseparated_margin_says_how_many_documents_each_cache_changes():
    """Averages that cannot separate the caches, while the documents they score differently from
    BF16 do: each cell's share counted here by hand (flips both ways leave the average put)."""
    rng = np.random.default_rng(2)
    bf16 = rng.integers(0, 2, size=(5, 100)).astype(float)

    def flipped(n, gained=0):  # n documents a task changed both ways, then `gained` more won
        out = bf16.copy()
        for row in out:
            ones, zeros = np.flatnonzero(row == 1)[: n // 2], np.flatnonzero(row == 0)
            row[ones], row[zeros[: n // 2 + gained]] = 0.0, 1.0
        return out

    docs = {("bf16", "rtn"): bf16, ("c2r4", "quantmla"): flipped(2),
            ("c2r4", "quarot"): flipped(4, gained=1), ("c2r4", "smoothquant"): flipped(8),
            ("c2r4", "rtn"): flipped(20)}  # fmt: skip
    records = fewshot({cell: 100 * d.mean() for cell, d in docs.items()}, stderr=5.0)
    for r, d in zip(records, docs.values()):
        r["metrics"].update({f"docs/{t}": list(row) for t, row in zip(TASKS, d)})
    verdict = smol_column(claims_rows(records), "In accuracy, C2R4")[1]
    shares = {m: 100 * (docs["c2r4", m] != bf16).mean() for m in ("quantmla", "quarot", "rtn")}
    assert shares == {"quantmla": 2.0, "quarot": 5.0, "rtn": 20.0}
    lead = 100 * ((docs["c2r4", "quantmla"] != bf16) * 1.0 - (docs["c2r4", "quarot"] != bf16))
    se = lead.std(ddof=1) / np.sqrt(lead.size)  # float64 reference: one difference per document
    assert "not separated" in verdict and verdict.endswith(
        "; documents whose outcome differs from BF16's: QuantMLA 2.0 %, QuaRot† 5.0 %, RTN 20.0 % "
        f"(QuantMLA − QuaRot† {lead.mean():+.1f} ± {se:.1f} paired)"
    )


def reference_records(
    bpb: dict[tuple[str, str], np.ndarray], experiment="smol_table1", task="gsm8k_reference"
) -> list[dict]:
    return [
        {"experiment": experiment,
         "config": {"model": {"name": "smol_mla"}, "precision": {"name": p}, "method": {"name": m}},
         "metrics": {f"docs/{task}": list(v), f"acc/{task}": float(v.mean())}}
        for (p, m), v in bpb.items()
    ]  # fmt: skip


def test_gsm8k_reference_margin_is_paired_over_the_documents_lower_is_better():
    rng = np.random.default_rng(1)
    bf16 = rng.uniform(0.6, 1.2, 200)  # documents differ far more than the caches do
    bpb = {("bf16", "rtn"): bf16, ("c2r4", "rtn"): bf16 + 0.20, ("c2r4", "smoothquant"): bf16 + 0.05,
           ("c2r4", "quarot"): bf16 + 0.08 + rng.normal(0, 0.01, 200),
           ("c2r4", "quantmla"): bf16 + 0.03 + rng.normal(0, 0.01, 200)}  # fmt: skip
    d = bpb[("c2r4", "quantmla")] - bpb[("c2r4", "smoothquant")]
    se = d.std(ddof=1) / np.sqrt(200)
    value, verdict = smol_column(claims_rows(reference_records(bpb)), "On GSM8K, C2R4")
    assert value == (
        f"{d.mean():+.4f} ± {se:.4f} paired bits/byte vs SmoothQuant† "
        f"({bpb[('c2r4', 'quantmla')].mean():.4f} vs {bf16.mean() + 0.05:.4f}; "
        f"BF16 {bf16.mean():.4f}; 200 documents)"
    )
    assert verdict == "yes: order RTN < QuaRot† < SmoothQuant† < QuantMLA"
    bpb[("c2r4", "quantmla")] = bf16 + 0.05 + rng.normal(0, 0.01, 200)  # level with SmoothQuant†
    d = bpb[("c2r4", "quantmla")] - bpb[("c2r4", "smoothquant")]
    _, verdict = smol_column(claims_rows(reference_records(bpb)), "On GSM8K, C2R4")
    side = "behind" if d.mean() > 0 else "ahead"
    apart = abs(d.mean()) / (d.std(ddof=1) / np.sqrt(200))
    assert apart < 1.96 and verdict.startswith(f"**no**: {side} by {apart:.1f} standard errors")
    value, verdict = smol_column(claims_rows(reference_records(bpb)), "On GSM8K, C4R4")
    assert value == "—" and verdict == (
        "—: no records of RTN C4R4, SmoothQuant† C4R4, QuaRot† C4R4, QuantMLA C4R4: "
        "`python -m quantmla.run experiment=smol_table1 eval=table1_suite "
        "eval.tasks=[gsm8k_reference] eval.limit=250 precision=c4r4 "
        "method=rtn,smoothquant,quarot,quantmla`"
    )


def test_a_ranking_shows_the_gsm8k_reference_order_beside_the_perplexities():
    ppl = {("bf16", "rtn"): 20.0, ("c2r4", "rtn"): 30.0, ("c2r4", "smoothquant"): 22.0,
           ("c2r4", "quarot"): 24.0, ("c2r4", "quantmla"): 21.0}  # fmt: skip
    bpb = {("c2r4", "rtn"): 0.9, ("c2r4", "smoothquant"): 0.85, ("c2r4", "quarot"): 0.83,
           ("c2r4", "quantmla"): 0.77}  # fmt: skip
    records = table1(ppl) + reference_records({k: np.full(4, v) for k, v in bpb.items()})
    value, verdict = smol_column(claims_rows(records), "Ranking")
    assert value == "RTN < QuaRot† < SmoothQuant† < QuantMLA"
    assert verdict.startswith("**no**: a different order") and verdict.endswith(
        "; on GSM8K's reference solutions (C2R4, bits/byte) RTN < SmoothQuant† < QuaRot† < "
        "QuantMLA: the paper's order"
    )
    bpb[("c2r4", "smoothquant")] = 0.80  # now ahead of QuaRot† there too
    records = table1(ppl) + reference_records({k: np.full(4, v) for k, v in bpb.items()})
    verdict = smol_column(claims_rows(records), "Ranking")[1]
    assert verdict.endswith("(C2R4, bits/byte) RTN < QuaRot† < SmoothQuant† < QuantMLA")


def test_a_ranking_joins_methods_the_paired_documents_do_not_separate():
    """Neighbours in the GSM8K order within 1.96 paired standard errors are joined by ≈, and the
    drawn-shots task's order follows the shared prompt's."""
    ppl = {("bf16", "rtn"): 20.0, ("c2r4", "rtn"): 30.0, ("c2r4", "smoothquant"): 22.0,
           ("c2r4", "quarot"): 24.0, ("c2r4", "quantmla"): 21.0}  # fmt: skip
    rng = np.random.default_rng(2)
    base = rng.uniform(0.6, 1.2, 100)
    shared = {("c2r4", "rtn"): base + 0.2, ("c2r4", "smoothquant"): base + 0.08,
              ("c2r4", "quarot"): base + 0.07, ("c2r4", "quantmla"): base + 0.01}  # fmt: skip
    noise = rng.normal(0, 0.05, 100)
    drawn = {("c2r4", "rtn"): base + 0.2, ("c2r4", "smoothquant"): base + 0.08,
             ("c2r4", "quarot"): base + 0.08 + noise, ("c2r4", "quantmla"): base + 0.01}  # fmt: skip
    d = noise  # QuaRot† − SmoothQuant† with drawn shots: float64 paired reference
    assert abs(d.mean()) < 1.96 * d.std(ddof=1) / np.sqrt(d.size)
    worse = "QuaRot† ≈ SmoothQuant†" if d.mean() > 0 else "SmoothQuant† ≈ QuaRot†"
    records = (table1(ppl) + reference_records(shared)
               + reference_records(drawn, "smol_gsm8k_drawn", "gsm8k_reference_drawn"))  # fmt: skip
    assert smol_column(claims_rows(records), "Ranking")[1].endswith(
        "; on GSM8K's reference solutions (C2R4, bits/byte) RTN < SmoothQuant† < QuaRot† < "
        f"QuantMLA: the paper's order; with each document's own 5 shots RTN < {worse} < QuantMLA"
    )


def test_gsm8k_margin_reads_the_whole_test_set_where_every_cell_has_it():
    """The whole-test-set experiment's cells replace the 250-document ones only when complete."""
    rng = np.random.default_rng(3)
    cells = ("bf16", "rtn"), *(("c4r4", m) for m in ("rtn", "smoothquant", "quarot", "quantmla"))
    shift = dict(zip(cells, (0.0, 0.02, 0.001, 0.006, 0.003)))
    few, many = rng.uniform(0.6, 1.2, 250), rng.uniform(0.6, 1.2, 1319)
    noise = {n: rng.normal(0, 0.002, (len(cells), n)) for n in (250, 1319)}
    subset = {c: few + shift[c] + noise[250][i] for i, c in enumerate(cells)}
    whole = {c: many + shift[c] + noise[1319][i] for i, c in enumerate(cells)}
    d = whole[("c4r4", "quantmla")] - whole[("c4r4", "smoothquant")]  # float64 paired reference
    records = reference_records(subset) + reference_records(whole, "smol_gsm8k_full")
    value, _ = smol_column(claims_rows(records), "On GSM8K, C4R4")
    assert value.startswith(f"{d.mean():+.4f} ± {d.std(ddof=1) / np.sqrt(d.size):.4f} paired")
    assert value.endswith("; 1319 documents)")
    del whole[("c4r4", "quarot")]  # incomplete: the 250 documents again
    records = reference_records(subset) + reference_records(whole, "smol_gsm8k_full")
    assert smol_column(claims_rows(records), "On GSM8K, C4R4")[0].endswith("; 250 documents)")


def test_a_gsm8k_miss_names_whether_each_methods_paths_add_up():
    """Behind the best baseline, the row gives QuantMLA's and that baseline's interaction over the
    250 documents: C4R4 − C4R16 − C16R4 + BF16, paired, from the path split's records."""
    rng = np.random.default_rng(4)
    base = rng.uniform(0.6, 1.2, 250)
    level = {("bf16", "rtn"): 0.0, ("c4r4", "rtn"): 0.02, ("c4r4", "smoothquant"): 0.001,
             ("c4r4", "quarot"): 0.006, ("c4r4", "quantmla"): 0.003}  # fmt: skip
    table = {c: base + v + rng.normal(0, 0.001, 250) for c, v in level.items()}
    split = {(p, m): base + v + rng.normal(0, 0.001, 250)
             for p, v in (("c4r16", 0.002), ("c16r4", 0.003)) for m in ("smoothquant", "quantmla")}  # fmt: skip
    records = reference_records(table) + reference_records(split, "smol_path_split")
    _, verdict = smol_column(claims_rows(records), "On GSM8K, C4R4")
    shown = []
    for m, label in (("quantmla", "QuantMLA"), ("smoothquant", "SmoothQuant†")):
        x = table[("c4r4", m)] - split[("c4r16", m)] - split[("c16r4", m)] + table[("bf16", "rtn")]
        shown.append(f"{label} {x.mean():+.4f} ± {x.std(ddof=1) / np.sqrt(x.size):.4f}")
    assert verdict.startswith("**no**: behind by") and verdict.endswith(
        "; the paths' interaction C4R4 − C4R16 − C16R4 + BF16 (below 0: they cost less together): "
        + ", ".join(shown)
    )
    del split[("c16r4", "smoothquant")]  # the baseline's RoPE key alone missing: nothing said
    records = reference_records(table) + reference_records(split, "smol_path_split")
    assert "interaction" not in smol_column(claims_rows(records), "On GSM8K, C4R4")[1]


def test_perplexity_rows_read_the_full_sets_where_every_cell_has_them():
    """The full sets' 2,048-token records replace the first windows' per row when complete; their
    4,096-token records never enter a 2,048 row."""
    first = {("bf16", "rtn"): 20.0, ("c4r4", "quantmla"): 20.1, ("c2r4", "rtn"): 30.0,
             ("c2r4", "smoothquant"): 25.0, ("c2r4", "quarot"): 22.0, ("c2r4", "quantmla"): 21.0}  # fmt: skip
    full = {("bf16", "rtn"): 18.0, ("c4r4", "quantmla"): 18.36}  # +2.00 %: not within 1 %
    at_4096 = {("bf16", "rtn"): 16.0, ("c4r4", "quantmla"): 16.0}  # read first, were it read
    records = table1(first) + [
        {**r, "config": {**r["config"], "model": {"name": "smol_mla", "eval_seqlen": n}}}
        for n, cells in ((4096, at_4096), (2048, full))
        for r in table1(cells, experiment="smol_table1_full")
    ]  # fmt: skip
    rows = claims_rows(records)
    assert smol_column(rows, "C4R4 QuantMLA") == (
        "+2.00 % ppl (full sets)",
        "**no**: more than 1 % from BF16",
    )
    # the C2R4 rows need cells the full sets lack: the first windows, unlabelled
    assert smol_column(rows, "C2R4 QuantMLA") == ("+5.00 % vs QuaRot† +10.00 %", "yes")
    assert smol_column(rows, "Ranking")[0] == "RTN < SmoothQuant† < QuaRot† < QuantMLA"
