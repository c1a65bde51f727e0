"""Faults a user meets: each reproduced here first, then handled (issue: no result lost to a late
error, no sweep stuck on a bad record, a CLI that answers fast and quietly)."""

import errno
import json
import os
import subprocess
import sys

import pytest

from quantmla.cli import DEFAULT_PRECISION, route_precision
from quantmla.errors import ConfigError, QuantMLAError
from quantmla.run import run
from quantmla.tracking import store
from tests.conftest import REPO, needs_tiny, run_config, tiny_job


def test_unwritable_results_dir_stops_before_any_work(tmp_path, monkeypatch):
    import quantmla.prepare

    monkeypatch.setattr(quantmla.prepare, "prepare", lambda *a, **k: pytest.fail("loaded a model"))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(
        ConfigError, match=r"paths.results_dir=.*a-file/results.*writable folder"
    ) as info:
        run(run_config(f"paths.results_dir={blocker}/results", "logger=none"))
    assert "\n" not in str(info.value)


@needs_tiny
def test_record_that_cannot_be_written_still_reports_its_numbers(tmp_path, monkeypatch, capsys):
    def read_only(path, payload):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(store, "write_atomic", read_only)
    with pytest.raises(
        QuantMLAError, match=r"could not write the record to .*result.json \(Read-only"
    ):
        run(run_config(*tiny_job(tmp_path)))
    out = capsys.readouterr().out
    assert "| c4r4 | rtn |" in out and '"ppl/wikitext2"' in out  # table and metrics came first


@needs_tiny
def test_corrupt_record_is_moved_aside_and_its_job_recomputed(tmp_path, capsys):
    overrides = tiny_job(tmp_path)
    first = run(run_config(*overrides))
    path = next(tmp_path.glob("default/*/result.json"))
    path.write_text('{"config": {"trunc')
    again = run(run_config(*overrides))
    out = capsys.readouterr().out
    aside = list(path.parent.glob("result.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"config": {"trunc'
    assert f"{path} is not a valid record: moved to {aside[0].name}" in out
    assert (
        json.loads(path.read_text())["metrics"]
        == again["metrics"]
        == first["metrics"] | {"method/seconds": again["metrics"]["method/seconds"]}
    )
    path.write_text("garbage")  # force=true recovers the same way
    run(run_config(*overrides, "force=true"))
    assert json.loads(path.read_text())["config_hash"] == first["config_hash"]


def test_table_building_skips_corrupt_records(tmp_path):
    (tmp_path / "exp" / "a").mkdir(parents=True)
    (tmp_path / "exp" / "a" / "result.json").write_text("{")
    store.write_atomic(tmp_path / "exp" / "b" / "result.json", {"metrics": {}})
    with pytest.warns(store.CorruptRecordWarning, match=r"exp/a/result.json: not a valid record"):
        records = store.load_records(tmp_path, "exp")
    assert records == [{"metrics": {}}]


@pytest.mark.parametrize("store_state", ["missing", "empty", "only-corrupt"])
def test_tables_from_an_empty_store_fail_and_overwrite_nothing(tmp_path, store_state):
    results, out = tmp_path / "results", tmp_path / "tables"
    if store_state != "missing":
        (results / "tiny_table1" / "x").mkdir(parents=True)
    if store_state == "only-corrupt":
        (results / "tiny_table1" / "x" / "result.json").write_text("{")
    out.mkdir()
    (out / "tiny_table1.md").write_text("committed table\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "analysis.tables",
            "tiny_table1",
            "--results",
            str(results),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert f"no records for tiny_table1 in {results / 'tiny_table1'}" in proc.stderr
    assert (out / "tiny_table1.md").read_text() == "committed table\n"
    assert not (out / "tiny_table1.tex").exists()


def test_figure_regeneration_is_byte_identical(tmp_path):
    from analysis.figures import fig5a

    records = [
        run(
            run_config(
                "eval=memory", f"precision={p}", "logger=none", f"paths.results_dir={tmp_path}"
            )
        )
        for p in ("bf16", "c4r4", "c2r4")
    ]
    first = {p.name: p.read_bytes() for p in fig5a(records, tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in fig5a(records, tmp_path / "b")}
    assert first == second and len(first) == 2


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, monkeypatch, capsys):
    import quantmla.prepare
    from quantmla import run as run_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quantmla.prepare, "prepare", interrupted)
    store.write_atomic(tmp_path / "default" / "done" / "result.json", {"metrics": {}})
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "quantmla.run",
            f"paths.results_dir={tmp_path}",
            "logger=none",
            f"hydra.run.dir={tmp_path}/out",
        ],
    )
    with pytest.raises(SystemExit) as info:
        run_module.main()
    assert info.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    # the earlier job's record in the folder is not this command's work (it used to be counted)
    assert (
        "interrupted: tiny_mla c4r4 rtn (perplexity); this command completed 0 record(s)" in err[0]
    )
    assert "rerun the same command to resume" in err[0]


def test_records_are_readable_by_the_group(tmp_path):
    old = os.umask(0o022)
    try:
        store.write_atomic(tmp_path / "r" / "result.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "r" / "result.json").stat().st_mode & 0o777 == 0o644


def test_precision_without_a_preset_file_routes_to_its_name():
    pinned = f"precision={DEFAULT_PRECISION}"  # an experiment's sweep over presets stays one job
    assert route_precision(["precision=c3r8", "method=rtn"]) == [
        pinned,
        "precision.name=c3r8",
        "method=rtn",
    ]
    assert route_precision(["precision=c4r4,c2r4"]) == ["precision=c4r4,c2r4"]  # presets stay
    assert route_precision(["precision=c4r4,c3r8"]) == [pinned, "precision.name=c4r4,c3r8"]
    assert route_precision(["precision.sink=0"]) == ["precision.sink=0"]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["precision=c9r4"], "error: precision='c9r4' is not allowed"),
        (
            ["precision.group_size=48"],
            "error: group_size=48 is not allowed; allowed: a divisor of d_c=128",
        ),
        (["method.name=gptq"], "error: method.name='gptq' is not allowed"),
        (["eval.datasets=[imagenet]"], "error: eval.datasets='imagenet' is not allowed"),
        (  # a dataset without its split in eval.splits
            ["eval.datasets=[gsm8k]"],
            "error: eval.splits.gsm8k=None is not allowed; allowed: test, train",
        ),
    ],
)
def test_cli_config_errors_are_one_line_and_import_no_torch(args, expected, tmp_path):
    """Config errors and --help answer without importing torch, transformers or lightning."""
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['quantmla.run', *{args!r}, 'hydra.run.dir={tmp_path}/out']\n"
        "try:\n    runpy.run_module('quantmla.run', run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'lightning') if m in sys.modules]\n"
        "assert not heavy, heavy\nsys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and expected in proc.stderr


def test_help_starts_with_the_project_and_describes_fields():
    proc = subprocess.run(
        [sys.executable, "-m", "quantmla.run", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.startswith("quantmla — ")
    assert "python -m quantmla.run eval=perplexity" in proc.stdout
    assert (
        "precision.recent" in proc.stdout and "most recent tokens read unquantized" in proc.stdout
    )
