"""What each job cost (docs/results.md): wall minutes from the records of one testbed's model, the
calibration's split where a method calibrated, and how loaded the machine was — a job that shared
its cores took longer than it would alone, so the table says so rather than hiding it."""

from __future__ import annotations

SHARED_MARGIN = 0.5  # a 15-min load average this far above the core count: the job shared them


def _what(config: dict) -> str:
    """The evaluation in a few words: its kind and size."""
    e = config["eval"]
    kind = e["kind"]
    if kind == "perplexity":
        windows = e.get("max_windows") or "all"
        length = e.get("seqlen") or config["model"].get("eval_seqlen")
        nmse = f", NMSE {e['nmse_windows']}" if e.get("nmse_windows") else ""
        sets = f" × {len(e['datasets'])} sets" if e.get("datasets") else ""
        return f"perplexity {windows} × {length}{sets}{nmse}"
    if kind in ("lm_eval", "commonsense"):
        tasks = e.get("tasks") or []
        return f"{kind} {len(tasks)} tasks × {e.get('limit') or 'all'} docs"
    if kind == "sensitivity":
        return f"sensitivity {e.get('n_sequences')} × {e.get('seqlen')}, every layer"
    return kind


def _name(config: dict, group: str) -> str:
    """A group's name in a record (older records kept some groups as a bare name, or none)."""
    value = config.get(group, "—")
    return value.get("name", "—") if isinstance(value, dict) else str(value)


def _calibration(metrics: dict) -> str:
    report = metrics.get("method/report") or {}
    reused = sum(len(units) for units in (report.get("reused") or {}).values())
    if "seconds_fit" not in report:
        seconds = metrics.get("method/seconds") or 0.0
        if reused:  # every unit fitted by earlier jobs: nothing fitted here
            return f"{reused} units of earlier fits ({seconds / 60:.1f})"
        return f"{seconds / 60:.1f}" if seconds >= 6 else ""
    parts = [
        report.get(k, 0.0) / 60 for k in ("seconds_capture", "seconds_alpha_search", "seconds_fit")
    ]
    seconds, made = metrics.get("method/seconds"), 60 * sum(parts)
    if seconds is not None and seconds < made / 2:  # the report is its loaded artifact's
        return f"artifact loaded ({seconds / 60:.1f})"
    resumed = (
        f", resumed at step {report['resumed_at_step']}" if report.get("resumed_at_step") else ""
    )
    return (
        f"capture {parts[0]:.0f} / α {parts[1]:.0f} / fit {parts[2]:.0f} "
        f"(selection {report.get('seconds_selection', 0.0) / 60:.0f}){resumed}"
        + (f", {reused} units of earlier fits" if reused else "")
    )


def _reused(record: dict) -> str:
    """What the job's minutes leave out: work an earlier (stopped) run or job did for it."""
    m = record["metrics"]
    notes = ["resumed: the last run's minutes"] if any(k.startswith("resumed/") for k in m) else []
    if m.get("allocation/errors_loaded_from"):
        notes.append("the allocation's errors measured by an earlier job")
    return "".join(f" ({note})" for note in notes)


def _cpu_minutes(record: dict) -> str:
    """CPU time over all cores (records since 2026-12-04): pauses and sharing do not add to it."""
    seconds = record.get("cpu_time_s")
    return "not kept" if seconds is None else f"{seconds / 60:.1f}"


def _load(machine: dict) -> str:
    load, cpus = machine.get("load_15m"), machine.get("cpus")
    if load is None or cpus is None:
        return "not kept"
    return f"{load:.1f}" + (" (shared)" if load > cpus + SHARED_MARGIN else "")


def cost_rows(records: list[dict], model: str = "smol_mla") -> list[list[str]]:
    """One row per record of `model`, by experiment then minutes: what ran, on what, for how long."""
    header = [
        "experiment", "method", "precision", "evaluation", "minutes", "CPU-minutes",
        "of it, method (min)", "machine", "load (15 min, at the end)",
    ]  # fmt: skip
    mine = [r for r in records if r["config"]["model"]["name"] == model and "wall_time_s" in r]
    mine.sort(key=lambda r: (r["experiment"], r["wall_time_s"]))
    rows = [header]
    for r in mine:
        c, machine = r["config"], r.get("machine", {})
        where = machine.get("gpu") or f"{machine.get('cpus')} CPU cores"
        rows.append([
            r["experiment"], _name(c, "method"), _name(c, "precision"), _what(c) + _reused(r),
            f"{r['wall_time_s'] / 60:.1f}", _cpu_minutes(r), _calibration(r["metrics"]), where,
            _load(machine),
        ])  # fmt: skip
    return rows
