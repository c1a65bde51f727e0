from analysis.tables import method_table


def record(precision, method, **metrics):
    return {
        "config": {"precision": {"name": precision}, "method": {"name": method}},
        "metrics": metrics,
    }


def test_method_table_bolds_best_quantized_and_shows_missing():
    records = [
        record("bf16", "rtn", **{"ppl/wikitext2": 10.0, "ppl/c4": 20.0}),
        record("c4r4", "rtn", **{"ppl/wikitext2": 12.0, "ppl/c4": 21.0, "nmse/attn_mean": 1e-2}),
        record(
            "c4r4", "quantmla", **{"ppl/wikitext2": 11.0, "ppl/c4": 21.0, "nmse/attn_mean": 1e-3}
        ),
        record("c2r4", "rtn", **{"ppl/wikitext2": 30.0}),
    ]
    lines = method_table(records).splitlines()
    assert lines[2] == "| BF16 | — | 10.000 | 20.000 | — |"  # BF16 never bold
    c4r4 = {line.split(" | ")[1]: line for line in lines if line.startswith("| C4R4")}
    assert c4r4["QuantMLA"] == "| C4R4 | QuantMLA | **11.000** | **21.000** | **1.000e-03** |"
    assert (
        c4r4["RTN"] == "| C4R4 | RTN | 12.000 | **21.000** | 1.000e-02 |"
    )  # a tie is bold in both
    assert c4r4["QuaRot†"] == "| C4R4 | QuaRot† | — | — | — |"
    assert lines.index(c4r4["RTN"]) < lines.index(next(x for x in lines if x.startswith("| C2R4")))
