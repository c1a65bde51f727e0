"""analysis/costs.py: a job's minutes, its calibration split and whether it shared the machine."""

from analysis.costs import cost_rows


def record(
    experiment,
    minutes,
    load=None,
    report=None,
    method="rtn",
    model="smol_mla",
    method_s=None,
    cpu_minutes=None,
):
    machine = {"cpus": 2, "gpu": None, **({"load_15m": load} if load is not None else {})}
    metrics = {"method/report": report} if report else {}
    if method_s is not None:
        metrics["method/seconds"] = method_s
    return {
        "experiment": experiment,
        "wall_time_s": 60 * minutes,
        **({} if cpu_minutes is None else {"cpu_time_s": 60 * cpu_minutes}),
        "machine": machine,
        "metrics": metrics,
        "config": {
            "model": {"name": model, "eval_seqlen": 2048},
            "method": {"name": method},
            "precision": {"name": "c2r4"},
            "eval": {
                "kind": "perplexity",
                "max_windows": 8,
                "datasets": ["wikitext2", "c4"],
                "nmse_windows": 4,
            },
        },
    }


def test_cost_rows_say_minutes_split_and_sharing():
    fit = {"seconds_capture": 240, "seconds_alpha_search": 480, "seconds_fit": 3600,
           "seconds_selection": 600, "resumed_at_step": 0}  # fmt: skip
    rows = cost_rows([
        record("b", 10.0, load=4.2, cpu_minutes=9.0),
        record("b", 7.5, load=2.1),
        record("a", 80.0, report=fit, method="quantmla"),
        record("a", 5.0, model="tiny_mla_v2"),  # another testbed's: left out
    ])  # fmt: skip
    assert [r[0] for r in rows[1:]] == ["a", "b", "b"]  # by experiment, then minutes
    quantmla, alone, shared = rows[1:]
    assert quantmla[4] == "80.0" and quantmla[6] == "capture 4 / α 8 / fit 60 (selection 10)"
    assert quantmla[5] == quantmla[8] == "not kept"
    assert alone[3] == "perplexity 8 × 2048 × 2 sets, NMSE 4" and alone[8] == "2.1"
    # sharing the cores: 10 wall minutes, 9 CPU-minutes over both (alone ~2 per minute)
    assert shared[4] == "10.0" and shared[5] == "9.0" and shared[8] == "4.2 (shared)"


def test_a_resumed_calibration_says_its_minutes_are_a_part():
    fit = {
        "seconds_capture": 60,
        "seconds_alpha_search": 0,
        "seconds_fit": 600,
        "resumed_at_step": 200,
    }
    (_, row) = cost_rows([record("a", 12.0, report=fit, method="quantmla")])
    assert row[6].endswith("resumed at step 200")
    # a job that loaded the artifact carries its report, but spent none of that time
    (_, row) = cost_rows([record("a", 12.0, report=fit, method="quantmla", method_s=3.0)])
    assert row[6] == "artifact loaded (0.1)"
    (_, row) = cost_rows([record("a", 12.0, report=fit, method="quantmla", method_s=700.0)])
    assert row[6].startswith("capture 1 / α 0 / fit 10")
    # units taken from earlier fits: all of them (nothing fitted), or a part
    assembled = {
        "reused": {"x.safetensors": ["0/content", "1/content"], "y.safetensors": ["0/rope"]}
    }
    (_, row) = cost_rows([record("a", 9.0, report=assembled, method="quantmla", method_s=1.2)])
    assert row[6] == "3 units of earlier fits (0.0)"
    (_, row) = cost_rows(
        [record("a", 12.0, report={**fit, **assembled}, method="quantmla", method_s=700.0)]
    )
    assert row[6].endswith("resumed at step 200, 3 units of earlier fits")


def test_a_resumed_job_or_reused_allocation_says_its_minutes_leave_work_out():
    resumed, reused, plain = (record("a", 5.0) for _ in range(3))
    resumed["metrics"]["resumed/windows/wikitext2"] = 4
    reused["metrics"]["allocation/errors_loaded_from"] = "0123456789abcdef.json"
    rows = {
        id(r): row
        for r, row in zip((resumed, reused, plain), cost_rows([resumed, reused, plain])[1:])
    }
    assert rows[id(resumed)][3].endswith("(resumed: the last run's minutes)")
    assert rows[id(reused)][3].endswith("(the allocation's errors measured by an earlier job)")
    assert rows[id(plain)][3] == "perplexity 8 × 2048 × 2 sets, NMSE 4"
