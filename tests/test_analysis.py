from analysis.tables import LAYOUTS, TINY_TASKS, build, to_latex, to_markdown


def record(model, precision, method, **metrics):
    return {
        "config": {
            "model": {"name": model},
            "precision": {"name": precision},
            "method": {"name": method},
        },
        "metrics": metrics,
    }


TASKS = [c.metric for c in LAYOUTS["table1"].columns]


def full(value):
    return {t: value for t in TASKS}


def test_table1_layout_bold_average_missing_and_paper():
    records = [
        record("deepseek_v2_lite", "bf16", "rtn", **full(60.0)),
        record("deepseek_v2_lite", "c4r4", "rtn", **full(50.0)),
        record("deepseek_v2_lite", "c4r4", "quantmla", **{**full(59.0), "acc/gsm8k": 35.25}),
        record(
            "deepseek_v2_lite", "c4r4", "quarot", **{t: 50.0 for t in TASKS[:-1]}
        ),  # one task missing
    ]
    paper = {"table1": {"deepseek_v2_lite": {"c4r4": {"quantmla": {"gsm8k": 35.25}}}}}
    rows = build(records, LAYOUTS["table1"], paper)
    header, *body = rows
    assert header[:3] == ["model", "precision", "method"] and header[-1] == "Avg"
    by = {(r[1], r[2]): r for r in body}
    bf16 = by[("BF16", "—")]
    assert bf16[-1] == "60.00" and not any("**" in c for c in bf16)  # BF16 never bold
    quantmla = by[("C4R4", "QuantMLA")]
    assert quantmla[3] == "**59.00**"
    gsm8k = 3 + TASKS.index("acc/gsm8k")
    assert quantmla[gsm8k] == "35.25 (paper 35.25)"  # RTN's and QuaRot's 50.00 win this column
    assert (
        by[("C4R4", "RTN")][gsm8k] == "**50.00**" and by[("C4R4", "QuaRot†")][gsm8k] == "**50.00**"
    )  # tie
    assert quantmla[-1] == f"**{(59.0 * 9 + 35.25) / 10:.2f}**"  # equal weight per benchmark
    assert (
        by[("C4R4", "QuaRot†")][-1] == "—" and by[("C4R4", "QuaRot†")][-2] == "—"
    )  # missing, never zero
    assert by[("C4R4", "SmoothQuant†")][3:] == ["—"] * (len(header) - 3)
    assert "| deepseek_v2_lite | C4R4 | QuantMLA | **59.00** |" in to_markdown(rows)
    latex = to_latex(rows)
    assert r"\textbf{59.00}" in latex and "SmoothQuant$^\\dagger$" in latex and "--" in latex


def test_tiny_table_lower_is_better_merges_jobs_and_averages_only_tasks():
    tasks = {f"acc/{t}": 40.0 for t in TINY_TASKS}
    records = [
        record("tiny_mla", "bf16", "rtn", **{"ppl/wikitext2": 10.0}),
        record("tiny_mla", "c2r4", "rtn", **{"ppl/wikitext2": 12.0, "nmse/attn_mean": 1e-2}),
        record("tiny_mla", "c2r4", "quantmla", **{"ppl/wikitext2": 11.0, "nmse/attn_mean": 1e-3}),
        # the lm-eval job of the same cell: merged into its row
        record("tiny_mla", "c2r4", "quantmla", **tasks, **{"acc_stderr/piqa": 2.5}),
    ]
    rows = build(records, LAYOUTS["tiny_table1"])
    assert rows[0][5:7] == ["attn-output NMSE", "HellaSwag"] and rows[0][-1] == "Avg"
    quantmla = {(r[1], r[2]): r for r in rows[1:]}[("C2R4", "QuantMLA")]
    # the only method with task scores: nothing to be best of, so not bold; ppl not averaged
    assert quantmla[7] == "40.00 ± 2.50" and quantmla[-1] == "40.00"
    by = {(r[1], r[2]): r for r in rows[1:]}
    assert (
        by[("C2R4", "QuantMLA")][3] == "**11.000**"
        and by[("C2R4", "QuantMLA")][5] == "**1.000e-03**"
    )
    assert by[("C2R4", "RTN")][3] == "12.000"
    assert [r[1] for r in rows[1:]][0] == "BF16"


def test_path_split_keeps_its_precisions_beside_the_table1_rows():
    records = [
        record("smol_mla", p, m, **{"ppl/wikitext2": ppl})
        for p, m, ppl in [("bf16", "rtn", 20.0), ("c2r4", "quarot", 24.0), ("c4r4", "rtn", 21.0),
                          ("c2r16", "quarot", 23.0), ("c16r4", "quarot", 20.5),
                          ("c4r16", "rtn", 20.8), ("c3r4", "rtn", 22.0)]
    ]  # fmt: skip
    rows = build(records, LAYOUTS["smol_path_split"])  # C3R4 is no path split's: left out
    shown = list(dict.fromkeys(r[1] for r in rows[1:]))
    assert shown == ["BF16", "C4R4", "C2R4", "C4R16", "C16R4", "C2R16"]
    assert LAYOUTS["smol_path_split"].also == ("smol_table1",)


def test_full_set_table_keeps_each_length_in_its_own_columns():
    records = []
    for n, ppl in ((2048, 20.0), (4096, 19.0)):
        r = record("smol_mla", "bf16", "rtn", **{"ppl/wikitext2": ppl, "ppl/c4": ppl + 3})
        r["config"]["model"]["eval_seqlen"] = n
        records.append(r)
    (header, row) = build(records, LAYOUTS["smol_table1_full"])
    assert row[header.index("WikiText-2 ppl (2K)")] == "20.000"
    assert row[header.index("WikiText-2 ppl (4K)")] == "19.000"
    assert row[header.index("C4 ppl (4K)")] == "22.000"


def test_smol_table1_counts_the_documents_each_cache_scores_unlike_bf16():
    from analysis.tables import SMOL_FEWSHOT

    bf16 = {t: [1, 0, 1, 1] for t in SMOL_FEWSHOT}
    flips = {"rtn": 3, "quantmla": 1}  # documents changed over all tasks, each way
    records = [record("smol_mla", "bf16", "rtn", **{f"docs/{t}": d for t, d in bf16.items()})]
    for method, n in flips.items():
        docs = {t: list(d) for t, d in bf16.items()}
        for i in range(n):
            t = SMOL_FEWSHOT[i]
            docs[t][i] = 1 - docs[t][i]
        records.append(
            record("smol_mla", "c2r4", method, **{f"docs/{t}": d for t, d in docs.items()})
        )
    records.append(
        record("smol_mla", "c2r4", "quarot", **{f"docs/{SMOL_FEWSHOT[0]}": [1, 1, 1, 1]})
    )
    header, *body = build(records, LAYOUTS["smol_table1"])
    by = {(r[1], r[2]): r[header.index("docs ≠ BF16 %")] for r in body}
    total = 4 * len(SMOL_FEWSHOT)
    assert by[("C2R4", "RTN")] == f"{100 * 3 / total:.1f}"
    assert by[("C2R4", "QuantMLA")] == f"**{100 * 1 / total:.1f}**"  # fewest changed: bold
    assert by[("C2R4", "QuaRot†")] == "—" and by[("BF16", "—")] == "—"  # not every task; itself


def test_smol_table1_pairs_gsm8k_reference_bits_per_byte_with_bf16():
    """Δ = mean per-document change, ± its standard error (sample std / √n); lower is better."""
    bf16 = [0.8, 0.9, 1.0, 0.7]
    rows = {"rtn": [1.0, 1.2, 1.1, 0.9], "quantmla": [0.85, 0.9, 1.05, 0.75]}
    records = [record("smol_mla", "bf16", "rtn", **{"docs/gsm8k_reference": bf16})]
    for method, docs in rows.items():
        records.append(
            record(
                "smol_mla",
                "c2r4",
                method,
                **{"acc/gsm8k_reference": sum(docs) / 4, "docs/gsm8k_reference": docs},
            )
        )
    header, *body = build(records, LAYOUTS["smol_table1"])
    by = {(r[1], r[2]): r for r in body}
    paired = header.index("GSM8K ref. bits/byte − BF16 (paired)")
    # RTN: changes 0.2, 0.3, 0.1, 0.2: mean 0.2, std sqrt(0.02 / 3), se that / 2
    assert by[("C2R4", "RTN")][paired] == f"+0.2000 ± {(0.02 / 3) ** 0.5 / 2:.4f}"
    assert by[("C2R4", "QuantMLA")][paired] == f"**+0.0375** ± {(0.001875 / 3) ** 0.5 / 2:.4f}"
    assert by[("C2R4", "QuaRot†")][paired] == "—" and by[("BF16", "—")][paired] == "—"
    value = header.index("GSM8K ref. bits/byte 5-shot")
    assert by[("C2R4", "QuantMLA")][value] == "**0.8875**"  # the lower mean: bold


def test_fig4_and_fig5b_draw_from_records(tmp_path):
    from analysis.figures import fig4, fig5b

    config = {
        "model": {"name": "deepseek_v2_lite"},
        "precision": {"name": "c4r4"},
        "method": {"name": "quantmla"},
    }
    latency = {"latency/heads": 16, "latency/device": "test"}
    for variant in ("bf16", "c4r4", "c2r4", "c4r4-dequant"):
        for context in (4096, 32768):
            for batch in (8, 32):
                latency[f"vs_bf16/{variant}/b{batch}/{context}"] = 1.0 if variant == "bf16" else 0.5
    ruler = {f"ruler/s_niah_{i}/{n}": 50.0 for i in (1, 2, 3) for n in (4096, 8192)}
    ruler |= {f"ruler/s_niah_{i}/avg": 50.0 for i in (1, 2, 3)} | {"ruler/samples_per_length": 5}
    written = fig5b([{"config": config, "metrics": latency}], tmp_path, "f5b")
    written += fig4([{"config": config, "metrics": ruler}], tmp_path, "f4")
    assert all(p.stat().st_size > 1000 for p in written)


def test_fig5c_sweep_pairs_bf16_with_packed_per_policy_chunk_and_budget(tmp_path):
    """One row per (admission policy, chunk, budget) with both precisions; the ratio and the
    requests BF16 holds computed from the records; a cell with one precision only is left out."""
    from analysis.throughput import fig5c_sweep, sweep_rows

    def rec(precision, budget, first_chunk, tok_s, capacity, preempt, chunk=256, trial=0):
        metrics = {
            "throughput/output_tok_s": tok_s, "throughput/kv_capacity_tokens": capacity,
            "throughput/input_tokens": 3968, "throughput/output_tokens": 32,
            "throughput/preemptions": preempt, "throughput/recomputed_tokens": 10 * preempt,
            "throughput/requests": 5, "throughput/max_num_batched_tokens": chunk,
        }  # fmt: skip
        return {
            "config": {
                "model": {"name": "tiny_mla_v2_4k"}, "precision": {"name": precision},
                "eval": {"kv_cache_memory_bytes": budget, "first_chunk_admission": first_chunk,
                         **({"trial": trial} if trial else {})},
            },
            "metrics": metrics,
        }  # fmt: skip

    records = [
        rec("bf16", 25_000_000, True, 2.0, 6000, 12), rec("c4r4", 25_000_000, True, 6.0, 20000, 0),
        rec("bf16", 78_000_000, False, 5.0, 20000, 0), rec("c4r4", 78_000_000, False, 5.5, 70000, 0),
        rec("bf16", 30_000_000, False, 1.0, 7000, 0),
        rec("bf16", 25_000_000, True, 1.0, 6000, 60, 2048),
        rec("c4r4", 25_000_000, True, 4.0, 20000, 0, 2048),
    ]  # fmt: skip
    paper = {"bf16_tok_s": 2.61, "c4r4_tok_s": 13.51, "speedup": 5.168, "bf16_preemptions": 32}
    rows = sweep_rows(records, paper)
    assert [r[:3] for r in rows[1:4]] == [
        ["whole prompt", "256", "78"], ["first chunk", "256", "25"], ["first chunk", "2,048", "25"]
    ]  # fmt: skip
    assert rows[2][3] == "1.50" and rows[2][4] == "12" and rows[2][-1] == "3.00x"
    assert rows[1][-1] == "1.10x" and rows[3][-1] == "4.00x" and rows[-1][-1] == "5.168x"
    assert all(p.stat().st_size > 1000 for p in fig5c_sweep(records, tmp_path, "s", paper))
    # repeats (eval.trial): each repeat's own ratio; the median and min–max over them; a repeat
    # missing one precision is left out; tok/s and preemptions are medians
    repeated = records + [
        rec("bf16", 25_000_000, True, 3.0, 6000, 14, trial=1), rec("c4r4", 25_000_000, True, 6.0, 20000, 0, trial=1),
        rec("bf16", 25_000_000, True, 1.5, 6000, 13, trial=2), rec("c4r4", 25_000_000, True, 7.5, 20000, 0, trial=2),
        rec("c4r4", 25_000_000, True, 99.0, 20000, 0, trial=3),
    ]  # fmt: skip
    row = sweep_rows(repeated)[2]
    assert row[-1] == "3.00x [2.00–5.00] (3)"  # ratios 3.0, 2.0, 5.0
    assert row[4] == "13" and row[6] == "2.00" and row[9] == "6.00"
    assert all(p.stat().st_size > 1000 for p in fig5c_sweep(repeated, tmp_path, "r", paper))


def test_throughput_repeats_are_separate_records_and_the_first_keeps_its_key():
    """eval.trial keys each repeat apart; trial 0 is left out, so records written before
    repeats existed keep their keys."""
    from quantmla.job import narrow_eval

    base = {"eval": {"kind": "throughput", "requests": 5, "trial": 0}, "model": {"name": "m"}}
    first = narrow_eval(base)
    again = narrow_eval({**base, "eval": {**base["eval"], "trial": 1}})
    assert "trial" not in first["eval"] and again["eval"]["trial"] == 1


def test_kernels_compile_table_summarises_per_kernel_and_lists_hot_rows():
    """From an aot report: per (kernel, arch) the count and worst resources; hot rows alone."""
    from analysis.kernels import hot_rows, markdown, summary_rows

    def entry(kernel, arch, regs, spill, shared, hot=False, problems=()):
        return {
            "kernel": kernel, "arch": arch, "paths": ["decode"], "formats": ["c4r4"], "d_c": [512],
            "page": [64], "constexprs": {"BLOCK_H": "16", "TILE": "16", "PAGE": "64"},
            "num_warps": 8, "registers": regs, "spill_stores": spill, "spill_loads": spill,
            "shared_bytes": shared, "blocks_per_sm": 1, "cubin_bytes": 40960, "hot": hot,
            "problems": list(problems),
        }  # fmt: skip

    report = {
        "specialisations": 2, "recorded_launches": 5, "archs": {"80": "", "90": ""},
        "triton": "3.9.0", "failures": ["x"],
        "entries": [
            entry("_decode_split_kernel", 90, 222, 0, 79872, hot=True),
            entry("_decode_split_kernel", 90, 255, 64, 4096, problems=["spills"]),
            entry("_writer_kernel", 80, 40, 0, 0),
        ],
    }  # fmt: skip
    rows = summary_rows(report)
    assert rows[1][:3] == ["_decode_split_kernel", "sm_90", "2"]
    assert rows[1][4:7] == ["255", "64 / 64", "78.0"] and rows[1][-1] == "1"
    assert rows[2][:3] == ["_writer_kernel", "sm_80", "1"]
    hot = hot_rows(report)
    assert len(hot) == 2 and hot[1][3] == "BLOCK_H 16, TILE 16, PAGE 64" and hot[1][7] == "0 / 0"
    assert markdown(report).startswith("2 specialisations (from 5 recorded launches) x 2 archs")


def test_smol_testbed_tables_from_records():
    """The SmolLM2-MLA tables: change vs the source, a missing cell is "—", tasks in record order;
    RTN rows ordered BF16, C4R4, C2R4 with protection before none, Δ against the BF16 record."""
    from analysis import testbed

    def ref(row, kind, metrics, **ev):
        return {
            "config": {"model": {"row": row}, "eval": {"kind": kind, **ev}},
            "metrics": metrics,
            "created": "1",
        }

    tasks = {"tasks": ["piqa", "arc_easy"]}
    records = [
        ref("source", "perplexity", {"ppl/wikitext2": 20.0, "ppl/c4": 30.0, "windows/wikitext2": 4, "windows/c4": 2}),
        ref("published", "perplexity", {"ppl/wikitext2": 21.0, "ppl/c4": 29.4, "windows/wikitext2": 4, "windows/c4": 2}),
        ref("published", "commonsense", {"acc/piqa": 60.0, "acc_stderr/piqa": 2.2, "acc/arc_easy": 50.0, "acc/avg": 55.0}, **tasks),
    ]  # fmt: skip
    rows = testbed.testbed_rows(records)
    assert rows[0] == ["model", "WikiText-2 ppl", "C4 ppl", "windows", "PIQA", "ARC-e", "avg"]
    assert rows[1][1:4] == ["20.00", "30.00", "4 + 2"] and rows[1][4] == "—"
    assert rows[2][1:4] == ["—", "—", "—"]  # converted: no records
    assert rows[3][1:] == [
        "21.00 (+5.0 %)",
        "29.40 (-2.0 %)",
        "4 + 2",
        "60.0 ± 2.2",
        "50.0",
        "55.0",
    ]
    # the perplexity record with the most windows is shown; its change vs a shorter source run
    # is computed from both records' per-window NLLs on the windows both measured
    import math

    nll = {"nll_windows/wikitext2": [3.0, 3.2, 3.4, 3.1, 3.3], "nll_windows/c4": [3.3]}
    whole = {
        "ppl/wikitext2": math.exp(3.2),
        "ppl/c4": math.exp(3.3),
        "windows/wikitext2": 5,
        "windows/c4": 1,
        **nll,
    }
    base = {"nll_windows/wikitext2": [2.9, 3.0], "nll_windows/c4": [3.3]}
    records[0]["metrics"].update(base)
    rows = testbed.testbed_rows([*records, ref("published", "perplexity", whole)])
    first_two = 100 * (math.exp((3.0 + 3.2) / 2 - (2.9 + 3.0) / 2) - 1)
    assert rows[3][1] == f"{math.exp(3.2):.2f} ({first_two:+.1f} % on the first 2)"
    assert rows[3][2] == f"{math.exp(3.3):.2f} (+0.0 %)" and rows[3][3] == "5 + 1"

    def job(name, sink, recent, wt, nmse=None):
        metrics = {
            "ppl/wikitext2": wt,
            "windows/wikitext2": 16,
            **({"nmse/attn_mean": nmse} if nmse else {}),
        }
        return {
            "config": {"precision": {"name": name, "sink": sink, "recent": recent}},
            "metrics": metrics,
        }

    cost = testbed.rtn_cost_rows(
        [
            job("c2r4", 0, 0, 30.0),
            job("c4r4", 4, 128, 20.2, 1e-3),
            job("bf16", 4, 128, 20.0),
            job("c2r4", 4, 128, 24.0),
        ]
    )
    assert [r[:3] for r in cost[1:]] == [
        ["BF16", "—", "20.00"],
        ["C4R4", "sink 4 + recent 128", "20.20 (+1.0 %)"],
        ["C2R4", "sink 4 + recent 128", "24.00 (+20.0 %)"],
        ["C2R4", "none", "30.00 (+50.0 %)"],
    ]
    assert cost[2][4] == "1.000e-03" and cost[2][3] == "—"


def test_ruler_table_sets_the_papers_averages_beside_a_testbeds_quantmla_row():
    lengths = {f"ruler/s_niah_{k}/{n}": 50.0 for k in (1, 2, 3) for n in (1024, 2048, 4096, 8192)}
    averages = {f"ruler/s_niah_{k}/avg": 50.0 for k in (1, 2, 3)}
    records = [
        record("smol_mla", "bf16", "rtn", **lengths, **averages),
        record("smol_mla", "c4r4", "quantmla", **lengths, **averages),
        record("smol_mla", "c4r4", "rtn", **lengths, **{**averages, "ruler/s_niah_3/avg": 40.0}),
    ]
    paper = {"fig4_ruler": {"deepseek_v2_lite": {"c4r4": {"quantmla": {"s_niah_3": 87.2}}}}}
    header, *body = build(records, LAYOUTS["smol_fig4_ruler"], paper)
    assert header[3] == "S-NIAH-1 1K" and header[-1] == "S-NIAH-3 avg"
    by = {(r[1], r[2]): r for r in body}
    assert by[("C4R4", "QuantMLA")][-1] == "**50.0** (paper 87.2)"  # DeepSeek-V2-Lite's, beside
    assert by[("C4R4", "RTN")][-1] == "40.0" and by[("BF16", "—")][-1] == "50.0"


def test_a_calibration_variant_gets_its_own_row_after_the_papers():
    def quantmla(score, **calibration):
        r = record("smol_mla", "c4r4", "quantmla", **{"ruler/s_niah_3/avg": score})
        r["config"]["method"]["calibration"] = {"steps": 300, **calibration}
        return r

    records = [quantmla(20.0), quantmla(30.0, rope_positions=8192)]
    header, *body = build(records, LAYOUTS["smol_fig4_ruler"])
    methods = [r[2] for r in body]
    assert methods[-2:] == ["QuantMLA", "QuantMLA (rope_positions=8192)"]  # not merged
    assert body[-2][-1] == "20.0" and body[-1][-1] == "**30.0**"


def test_a_precision_off_the_paper_lists_only_the_methods_it_has():
    records = [
        record("smol_mla", "c4r4", "quantmla", **{"ppl/wikitext2": 11.0}),
        record("smol_mla", "c4r8", "quantmla", **{"ppl/wikitext2": 10.5}),
    ]
    rows = build(records, LAYOUTS["tiny_table1"])
    listed = [(r[1], r[2]) for r in rows[1:]]
    assert listed.count(("C4R4", "RTN")) == 1  # a paper precision: every method, missing as "—"
    assert [m for p, m in listed if p == "C4R8"] == ["QuantMLA"]


def test_path_interaction_is_cxr4_minus_each_path_alone_plus_bf16_paired_per_item():
    """Per window: C2R4 − C2R16 − C16R4 + BF16 (C4R4's with C4R16), mean ± sample-std/√n, and its
    share of the two paths' summed change; NMSE without a BF16 term, by the dataset of its windows;
    an extension's variant, another model or unmatched windows leave a cell out, a row of none
    is left out."""
    from analysis.path_split import interaction_rows

    def rec(precision, method, experiment="smol_path_split", datasets=("wikitext2",), **metrics):
        r = record("smol_mla", precision, method, **metrics)
        r["experiment"], r["config"]["eval"] = (
            experiment,
            {"kind": "perplexity", "datasets": list(datasets)},
        )
        return r

    nll = {
        "bf16": [2.0, 2.2, 2.4],
        "c2r16": [2.5, 2.6, 3.0],
        "c16r4": [2.1, 2.3, 2.5],
        "c2r4": [2.7, 2.8, 3.3],
    }
    records = [
        rec(p, "rtn" if p == "bf16" else "smoothquant", **{"nll_windows/wikitext2": v})
        for p, v in nll.items()
    ]
    nmse = {"c2r16": 0.07, "c16r4": 0.003, "c2r4": 0.08}
    records += [
        rec(p, "smoothquant", "smol_path_split_gsm8k", ("gsm8k",), **{"nmse/attn_mean": v})
        for p, v in nmse.items()
    ]
    variant = rec("c2r4", "smoothquant", "smol_path_split", **{"nll_windows/wikitext2": [9.0] * 3})
    variant["config"]["method"]["calibration"] = {"rope_objective": "output"}
    other = rec("c2r4", "quarot", **{"nll_windows/wikitext2": [2.9, 3.0, 3.1]})
    other["config"]["model"]["name"] = "tiny_mla_v2"
    short = rec("c2r4", "rtn", **{"nll_windows/wikitext2": [3.0, 3.0]})  # 2 windows, not 3
    alone = [rec(p, "rtn", **{"nll_windows/wikitext2": [2.5] * 3}) for p in ("c2r16", "c16r4")]
    records += [variant, other, short, *alone]
    c4 = {"c4r4": [2.3, 2.6, 2.5], "c4r16": [2.1, 2.3, 2.5], "c16r4": [2.1, 2.3, 2.5]}
    records += [rec(p, "quantmla", **{"nll_windows/wikitext2": v}) for p, v in c4.items()]
    header, *body = interaction_rows(records)
    rows = {(r[0], r[1]): dict(zip(header, r)) for r in body}
    c4r4 = rows.pop(("QuantMLA", "C4R4"))  # per window 0.1, 0.2, -0.1; the paths' sum 0.2 each
    c4_se = (0.07 / 3) ** 0.5 / 3**0.5
    assert c4r4["WikiText-2 ppl (Δ ln × 100)"] == f"{20 / 3:+.2f} ± {100 * c4_se:.2f} (+33 %)"
    rows = {method: row for (method, cache), row in rows.items() if cache == "C2R4"}
    excess = [0.1, 0.1, 0.2]  # c2r4 − c2r16 − c16r4 + bf16 per window
    mean, se = 0.4 / 3, (sum((x - 0.4 / 3) ** 2 for x in excess) / 2) ** 0.5 / 3**0.5
    share = 100 * mean / ((0.5 + 0.4 + 0.6) / 3 + (0.1 + 0.1 + 0.1) / 3)
    wikitext, nmse = "WikiText-2 ppl (Δ ln × 100)", "attn-output NMSE, {}"
    assert rows["SmoothQuant†"][wikitext] == f"{100 * mean:+.2f} ± {100 * se:.2f} ({share:+.0f} %)"
    assert rows["SmoothQuant†"][nmse.format("GSM8K text")] == f"{0.007:+.2e} ({700 / 73:+.0f} %)"
    assert rows["SmoothQuant†"][nmse.format("WikiText-2")] == "—"  # no WikiText-2 NMSE records
    assert "RTN" not in rows and "QuaRot†" not in rows  # unmatched windows; another model
