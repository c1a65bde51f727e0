"""Serving tests run in .venv-serve (`make serve-test`); references come from the project's venv.

They need vLLM (absent from the project's venv, where this folder is not collected), the
project's venv for exports and reference numbers, and the shared data."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except ImportError:  # the project's venv: these tests belong to `make serve-test`
    collect_ignore_glob = ["test_*.py"]

REPO = Path(__file__).resolve().parents[2]
PROJECT_PY = Path(os.environ.get("QUANTMLA_PROJECT_PY", REPO / ".venv" / "bin" / "python"))
SHARED = Path(os.environ.get("QUANTMLA_SHARED", REPO.parent / "shared"))
WIKITEXT = SHARED / "data" / "wikitext-2-raw-v1" / "wiki.test.raw"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process


def child_env() -> dict:
    """This process's environment without what is meant for it alone: an in-process vLLM engine's
    LD_PRELOAD (the serving venv's libgomp/tcmalloc) and tests/conftest.py's TRITON_INTERPRET=1
    (under which a reference's packed generate would run the Triton interpreter, minutes a call)."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TRITON_INTERPRET")}


def all_cores() -> None:
    """preexec_fn: a child may use every core (vLLM's CPU worker binds this process to fewer)."""
    os.sched_setaffinity(0, range(os.cpu_count()))


def project(*args: str, timeout: int = 600) -> str:
    """Run the project's venv python with `args` from the repository root; its stdout."""
    if not PROJECT_PY.is_file():
        pytest.skip(f"needs the project's venv at {PROJECT_PY} (make setup)")
    env = {
        **child_env(),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "offline",
    }
    done = subprocess.run(
        [str(PROJECT_PY), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout, preexec_fn=all_cores,
    )  # fmt: skip
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"{' '.join(args[:3])} failed ({done.returncode}): {done.stderr[-500:]}")
    return done.stdout


def export(out: Path, *overrides: str) -> Path:
    if not (out / "quantmla.json").is_file():
        project("-m", "quantmla.export", *overrides, f"out={out}", "overwrite=true")
    return out


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {
        name: export(root / name, "model=tiny_mla_v2", "method=rtn", f"precision={precision}")
        for name, precision in (("v2_rtn_c4r4", "c4r4"), ("v2_rtn_c2r4", "c2r4"))
    }


@pytest.fixture(scope="session")
def prompt_ids(exports) -> list[int]:
    """~700 WikiText-2 test tokens: past the 4 + 128 protection window, inside the trained 2K."""
    from transformers import AutoTokenizer

    if not WIKITEXT.is_file():
        pytest.skip(f"needs the shared data at {WIKITEXT}")
    text = WIKITEXT.read_text()[1000:4600]
    ids = AutoTokenizer.from_pretrained(exports["v2_rtn_c4r4"])(text).input_ids
    return ids[:700]


_PACKED: dict[tuple, dict] = {}  # one packed generate per (model, prompt, precision, tokens)


def packed_generate(model_dir, ids, precision, n, tmp) -> dict:
    """`python -m quantmla.generate cache.backend=packed` on exactly these prompt tokens (run once
    per session for each model, prompt, precision and length)."""
    key = (str(model_dir), tuple(ids), precision, n)
    if key not in _PACKED:
        _PACKED[key] = _packed_generate(model_dir, ids, precision, n, tmp)
    return _PACKED[key]


def _packed_generate(model_dir, ids, precision, n, tmp) -> dict:
    from transformers import AutoTokenizer

    text_file, out = Path(tmp) / "prompt.txt", Path(tmp) / f"packed-{precision}.json"
    text_file.write_text(AutoTokenizer.from_pretrained(model_dir).decode(ids))
    project(
        "-m", "quantmla.generate", "model=tiny_mla_v2", f"model.path={model_dir}",
        f"precision={precision}", "method=rtn", "cache.backend=packed", f"prompt_file={text_file}",
        f"max_new_tokens={n}", f"json_out={out}",
    )  # fmt: skip
    packed = json.loads(out.read_text())
    assert packed["prompt_token_ids"] == ids  # the same prompt tokens on both sides
    return packed


def reference_logprobs(model_dir, ids, precision="bf16", tmp=None) -> list:
    path = Path(tmp) / f"ids-{len(ids)}.json"
    path.write_text(json.dumps(ids))
    out = project(
        "tests/serving/project_side.py", "logprobs", "--model", str(model_dir),
        "--ids", str(path), "--precision", precision,
    )  # fmt: skip
    return json.loads(out)
