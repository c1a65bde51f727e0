"""Where things sit: installed names, per-kind record hashes, the store migration, and documents
whose commands and tables are real."""

import dataclasses
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from quantmla.evaluation.registry import EVALUATORS
from quantmla.job import narrow_eval
from quantmla.tracking.store import config_hash, load_record
from tests.conftest import DATA_DIR, REPO, needs_tiny, run_config

FIXTURE_STORE = REPO / "tests" / "fixtures" / "store_v1"  # written by commit ba0d4e8's code
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_wheel_ships_only_project_unique_top_level_names(tmp_path):
    """`kernels` would shadow Hugging Face's hub-kernels package; analysis/experiments are tools."""
    build = tmp_path / "src"
    shutil.copytree(
        REPO,
        build,
        ignore=shutil.ignore_patterns(
            ".venv*",
            ".git",
            "assets",
            "results",
            "outputs",
            "multirun",
            "wandb",
            "build",
            "*.egg-info",
        ),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(build),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("quantmla-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"quantmla", "quantmla_kernels"}
    assert "quantmla_kernels/paged_cache/decode.py" in names
    for source in ("dequant.cpp", "prefill.cpp", "vector_math.h"):  # the C++ ops build from these
        assert f"quantmla_kernels/paged_cache/{source}" in names
    assert "quantmla/evaluation/lm_eval/tasks/quantmla_mmlu.yaml" in names


def _job_config(kind_overrides: list[str]) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(run_config(*kind_overrides)), resolve=True)


KIND_PRESETS = {
    "perplexity": ["eval=perplexity"],
    "memory": ["eval=memory"],
    "lm_eval": ["eval=table1_suite"],
    "ruler": ["eval=ruler"],
    "retrieval": ["eval=retrieval"],
    "sensitivity": ["eval=sensitivity"],
    "probes": ["eval=probes"],
    "rope_positions": ["eval=rope_positions"],
    "ruler_answer": ["eval=ruler_answer"],
    "latency": ["eval=latency"],
    "throughput": ["eval=throughput"],
}


def test_the_kernels_folder_never_shadows_hugging_faces_kernels_package():
    """From the repository root `import kernels` gives the installed hub-kernels package that
    transformers >= 5.25 imports with every model, never our folder; transformers' modules import
    with or without that package."""
    code = (
        "import importlib.metadata as m, kernels, transformers.activations\n"
        "try:\n    m.version('kernels')\nexcept m.PackageNotFoundError:\n    print('absent')\n"
        "else:\n    print(kernels.__file__)\n"
        "import quantmla_kernels.paged_cache.ops\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert found == "absent" or not found.startswith(str(REPO / "kernels"))


def test_every_kind_has_a_preset_and_every_eval_field_belongs_to_a_kind():
    from quantmla.config import EvalConfig

    assert set(KIND_PRESETS) == set(EVALUATORS)
    claimed = {f for e in EVALUATORS.values() for f in e.fields}
    schema = {f.name for f in dataclasses.fields(EvalConfig)} - {"kind"}
    assert claimed <= schema, claimed - schema
    assert schema <= claimed, f"eval fields no evaluator reads: {schema - claimed}"


def test_adding_a_field_to_one_kind_leaves_every_other_kinds_hash_unchanged(monkeypatch):
    configs = {kind: _job_config(o) for kind, o in KIND_PRESETS.items()}
    before = {kind: config_hash(narrow_eval(c)) for kind, c in configs.items()}
    for changed, original in list(EVALUATORS.items()):
        grown = dataclasses.replace(original, fields=(*original.fields, "new_knob"))
        monkeypatch.setitem(EVALUATORS, changed, grown)
        for kind, config in configs.items():
            config = {**config, "eval": {**config["eval"], "new_knob": 7}}  # in every eval block
            after = config_hash(narrow_eval(config))
            assert (after != before[kind]) == (kind == changed), (changed, kind)
        monkeypatch.setitem(EVALUATORS, changed, original)


def test_a_kind_sees_only_its_own_eval_fields(tmp_path):
    from quantmla.job import resolve

    job = resolve(
        run_config("eval=memory", "model=deepseek_v2_lite", f"paths.results_dir={tmp_path}")
    )
    assert job.cfg.eval.context_lengths and job.cfg.eval.kind == "memory"
    with pytest.raises(AttributeError):
        job.cfg.eval.datasets  # noqa: B018  (a perplexity field: not part of this job)
    assert set(job.config["eval"]) == {"kind", "context_lengths"}
    assert job.record_path.parent.name == config_hash(job.config)


@needs_tiny
def test_migration_rekeys_a_store_written_before_per_kind_hashes(tmp_path):
    """The fixture store was written by the previous commit's code (full eval block hashed): after
    `python -m quantmla.migrate`, today's run of the same job finds its record and skips it; another
    entry point's record (no `method` in its config) is left as it was."""
    from quantmla.run import run

    store = tmp_path / "store"
    shutil.copytree(FIXTURE_STORE, store)
    foreign = store / "reference" / "abc" / "result.json"
    foreign.parent.mkdir(parents=True)
    foreign.write_text('{"config": {"eval": {"kind": "outliers"}, "precision": "bf16"}}')
    old = sorted(p.parent.name for p in store.glob("fixture/*/result.json"))
    proc = subprocess.run(
        [sys.executable, "-m", "quantmla.migrate", str(store)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 moved" in proc.stdout and "1 not run records" in proc.stdout
    assert foreign.read_text().startswith('{"config": {"eval"')
    new = sorted(p.parent.name for p in store.glob("fixture/*/result.json"))
    assert len(new) == 2 and not set(new) & set(old)
    again = subprocess.run(
        [sys.executable, "-m", "quantmla.migrate", str(store)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert "0 moved, 2 current" in again.stdout  # idempotent
    common = [
        f"paths.results_dir={store}",
        f"paths.data_dir={DATA_DIR}",
        "logger=none",
        "experiment_name=fixture",
    ]
    for overrides in (
        ["eval=memory"],
        ["eval=preview", "eval.max_windows=2", "eval.nmse_windows=1"],
    ):
        record = run(run_config(*common, *overrides))
        assert record["git_sha"] is not None and record["created"]  # the stored record, not a rerun
        assert load_record(store / "fixture" / record["config_hash"] / "result.json") == record
    assert sorted(p.parent.name for p in store.glob("fixture/*/result.json")) == new


def _commands(text: str) -> list[str]:
    """`python -m ...` commands of a page: fenced lines and inline code spans."""
    found = []
    for line in re.findall(r"`([^`\n]*python -m [^`\n]+)`", text) + re.findall(
        r"(?m)^\s*(?:[A-Z_]+=\S+ )*(python -m .+?)(?:\s+#.*)?$", text
    ):
        line = line[line.index("python -m") :]
        found += [c.strip() for c in re.split(r"\s;\s", line)]
    return found


def _groups() -> dict[str, set[str]]:
    conf = REPO / "conf"
    return {g.name: {p.stem for p in g.glob("*.yaml")} for g in conf.iterdir() if g.is_dir()}


def _check_command(command: str) -> None:
    from analysis.figures import FIGURES
    from analysis.tables import LAYOUTS, STUDY_TABLES

    words = shlex.split(command.replace("\\", " ").replace("...", ""), posix=True)
    module = words[2]
    assert importlib.util.find_spec(module) is not None, f"{command}: no module {module}"
    args = words[3:]
    if module == "analysis.tables":
        assert args[0] in set(LAYOUTS) | set(STUDY_TABLES), command
    elif module == "analysis.figures":
        assert args[0] in FIGURES, command
    elif module in ("quantmla.run", "quantmla.generate"):
        groups = _groups()
        for arg in args:
            key, _, value = arg.partition("=")
            if key in groups and "," not in value and "/" not in key:
                precision = key == "precision" and re.fullmatch(r"c\d+r\d+", value)
                assert value in groups[key] or precision, f"{command}: no {key}={value}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_python_m_command_in_the_docs_exists(page):
    commands = _commands(page.read_text())
    for command in commands:
        _check_command(command)
    for script in re.findall(r"python (benchmarks/\S+\.py)", page.read_text()):
        assert (REPO / script).is_file(), script
    for target in re.findall(r"`make ([a-z0-9-]+)", page.read_text()):
        assert re.search(rf"(?m)^{target}:", (REPO / "Makefile").read_text()), target


def _conf_commands(text: str) -> list[str]:
    """`python -m ...` commands in a config's comments, each up to a bracket, `;` or line end."""
    found = []
    for comment in re.findall(r"(?m)#(.*)$", text):
        for piece in comment.split("python -m ")[1:]:
            found.append("python -m " + re.split(r"[();`]", piece)[0].strip())
    return found


@pytest.mark.parametrize(
    "config", sorted((REPO / "conf").rglob("*.yaml")), ids=lambda p: str(p.relative_to(REPO))
)
def test_every_python_m_command_in_conf_comments_exists(config):
    """The regeneration commands an experiment advertises work as written."""
    for command in _conf_commands(config.read_text()):
        _check_command(command)
        experiment = re.search(r"--experiment (\S+)", command)
        if experiment:
            assert experiment[1] in _groups()["experiment"], command


def test_generated_table_blocks_equal_their_files():
    blocks = 0
    for page in DOCS:
        for name, body in re.findall(
            r"<!-- generated: (\S+) -->\n(.*?)\n?<!-- end generated -->",
            page.read_text(),
            re.DOTALL,
        ):
            assert body.strip() == (REPO / "docs" / "tables" / f"{name}.md").read_text().strip(), (
                page,
                name,
            )
            blocks += 1
    assert blocks >= 5


def test_embedding_refreshes_only_that_tables_blocks(tmp_path):
    from analysis.tables import embed_in_docs

    page = tmp_path / "page.md"
    page.write_text(
        "a\n<!-- generated: t1 -->\nold\n<!-- end generated -->\n<!-- generated: t2 -->\nkeep\n<!-- end generated -->\n"
    )
    empty = tmp_path / "empty.md"  # a block never generated yet
    empty.write_text(
        "<!-- generated: t1 -->\n<!-- end generated -->\n<!-- generated: t2 -->\nkeep\n<!-- end generated -->\n"
    )
    assert embed_in_docs("t1", "| new |\n", tmp_path) == [empty, page]
    assert empty.read_text().startswith(
        "<!-- generated: t1 -->\n| new |\n<!-- end generated -->\n<!-- generated: t2 -->\nkeep"
    )
    assert (
        page.read_text()
        == "a\n<!-- generated: t1 -->\n| new |\n<!-- end generated -->\n<!-- generated: t2 -->\nkeep\n<!-- end generated -->\n"
    )


def test_no_test_counts_ci_times_or_missing_spec_references_in_documents():
    for page in DOCS:
        text = page.read_text()
        assert not re.search(r"\d+ (passed|tests)\b", text), page
        assert "SPEC §" not in text, page
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
    for path in [
        *REPO.glob("quantmla/**/*.py"),
        *REPO.glob("kernels/**/*.py"),
        *REPO.glob("conf/**/*.yaml"),
    ]:
        assert "SPEC §" not in path.read_text(), path


def test_generate_config_writes_no_log_into_the_repository(tmp_path):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("generate", return_hydra_config=True)
    assert cfg.hydra.run.dir not in (".", "", None) and str(cfg.hydra.run.dir).startswith(
        "outputs/"
    )
    assert "*.log" in (REPO / ".gitignore").read_text().split()
    tracked = subprocess.run(
        ["git", "ls-files", "*.log"], cwd=REPO, capture_output=True, text=True
    ).stdout
    assert tracked.strip() == ""


def test_fixture_store_is_from_the_previous_layout():
    """Guard for the migration test: the fixture's records hash the whole eval block."""
    for path in FIXTURE_STORE.glob("*/*/result.json"):
        record = json.loads(path.read_text())
        assert "probes" in record["config"]["eval"]  # a field only the probes kind reads
        assert config_hash(record["config"]) == path.parent.name
        assert Path(path).parent.name != config_hash(narrow_eval(record["config"]))


def _contracts() -> list[dict]:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _layer_of(module: str, layers: list[list[str]]) -> int:
    """Index (0 = top) of the layer holding `module` (or its package)."""
    for i, names in enumerate(layers):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} is in no layer of the layers contract")


def _layers() -> list[list[str]]:
    (contract,) = [c for c in _contracts() if c["type"] == "layers"]
    return [[n.strip() for n in layer.split("|")] for layer in contract["layers"]]


def test_kernels_contract_forbids_every_other_module():
    """The kernels may import the spec, the quant math, the byte layout and errors: every other
    top-level module of quantmla is in the contract's forbidden list (a new module too)."""
    (contract,) = [c for c in _contracts() if c.get("source_modules") == ["quantmla_kernels"]]
    allowed = {
        "quantmla.spec",
        "quantmla.quant",
        "quantmla.memory",
        "quantmla.errors",
        "quantmla._lazy",
    }
    top = {
        f"quantmla.{p.stem}"
        for p in (REPO / "quantmla").iterdir()
        if p.stem != "__init__" and not p.name.startswith(".")
    }
    top = {
        m
        for m in top
        if (REPO / m.replace(".", "/")).is_dir() or (REPO / f"{m.replace('.', '/')}.py").is_file()
    }
    assert set(contract["forbidden_modules"]) == (top - allowed) | {"analysis", "experiments"}


def test_modules_imported_by_name_sit_at_or_below_their_importer():
    """The import-linter cannot see `importlib.import_module`: every module a registry names is
    importable and at its registrant's layer or below (evaluators, their checks, methods, lazy
    package exports, our own model families)."""
    import quantmla
    import quantmla.data
    from quantmla.methods.registry import METHODS
    from quantmla.models.loading import OWN_FAMILIES

    layers = _layers()
    named = [("quantmla.evaluation.registry", e.module) for e in EVALUATORS.values() if e.module]
    named += [
        ("quantmla.evaluation.registry", e.check.split(":")[0])
        for e in EVALUATORS.values()
        if e.check
    ]
    named += [
        ("quantmla.methods.registry", m.target.split(":")[0]) for m in METHODS.values() if m.target
    ]
    named += [("quantmla.models.loading", m) for m in OWN_FAMILIES.values()]
    named += [("quantmla.data", m) for m in set(quantmla.data._EXPORTS.values())]
    assert len(named) > 15
    for importer, module in named:
        assert importlib.util.find_spec(module) is not None, module
        assert _layer_of(module, layers) >= _layer_of(importer, layers), f"{importer} -> {module}"
    # the package's own exports are for users: anything but the CLIs
    for module in set(quantmla._EXPORTS.values()):
        assert _layer_of(module, layers) > _layer_of("quantmla.cli", layers), module


def test_architecture_table_lists_the_layers_contract_in_order():
    """docs/architecture.md's table names every module of the layers contract, in its order."""
    text = (REPO / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    named = [
        re.findall(
            r"`((?:quantmla|quantmla_kernels|analysis|experiments)[\w.]*)/?`", r.split("|")[2]
        )
        for r in rows
    ]
    named = [[n.rstrip("/") for n in row] for row in named if row]
    layers = _layers()
    flat = [n for row in named for n in row]
    in_contract = {n for layer in layers for n in layer}
    assert in_contract <= set(flat), in_contract - set(flat)
    order = [_layer_of(n, layers) for n in flat if n in in_contract]
    assert order == sorted(order), "the table's rows are not in the contract's layer order"


TEST_ORACLES = ("quantmla_kernels.paged_cache.reference", "quantmla_kernels.paged_cache.baselines")
# the Fig. 5b harness times the baselines and checks the interpreted kernels against the oracle
BENCHMARK_MODULES = {"quantmla/evaluation/latency_harness.py"}


def _project_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import in a file, function-level ones included."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.module, a.name) for a in node.names]
    return [(m, n) for m, n in out if m.split(".")[0] in ("quantmla", "quantmla_kernels")]


def test_production_code_imports_no_test_oracle_and_no_private_name():
    """`reference.py` and `baselines.py` serve tests and benchmarks only; no module imports another
    module's private (`_`) name. Production: the installed packages (quantmla/, kernels/)."""
    files = [*(REPO / "quantmla").rglob("*.py"), *(REPO / "kernels").rglob("*.py")]
    assert len(files) > 60
    bad = []
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        for module, name in _project_imports(path):
            target = f"{module}.{name}" if name else module
            oracle = any(
                target == o or target.startswith(o + ".") or module == o for o in TEST_ORACLES
            )
            if (
                oracle
                and rel not in BENCHMARK_MODULES
                and not rel.endswith(("reference.py", "baselines.py"))
            ):
                bad.append(f"{rel}: {target}")
            if name and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{rel}: {module} import {name}")
    assert not bad, bad


def test_each_cache_op_is_chosen_in_one_place():
    """The Triton / torch choice of the cache's ops lives in `ops.resolve`: no other production
    module compares a kernel setting with "triton" or "torch"."""
    files = [*(REPO / "quantmla").rglob("*.py"), *(REPO / "kernels").rglob("*.py")]
    pattern = re.compile(r"""kernel\w*\s*[!=]=\s*["'](triton|torch)["']""")
    hits = [
        f"{p.relative_to(REPO)}: {m.group(0)}"
        for p in files
        if p.name != "ops.py"
        for m in pattern.finditer(p.read_text())
    ]
    assert not hits, hits
