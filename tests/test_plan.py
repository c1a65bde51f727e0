"""The memory plan against hand-computed numbers, and the one-line refusal of a job its node cannot
hold. Arithmetic from the published configs (assets/model-configs)."""

import subprocess
import sys

import pytest

from quantmla.models.loading import config_from_file
from quantmla.models.sizes import param_counts
from tests.conftest import REPO

CONFIGS = REPO / "assets" / "model-configs"


def test_deepseek_v2_lite_parameters_by_hand():
    hidden, vocab, heads = 2048, 102400, 16
    embed = vocab * hidden  # embed_tokens; lm_head is the same size (untied)
    attention = (
        hidden * heads * (128 + 64)  # q_proj (no query LoRA): nope 128 + rope 64 per head
        + hidden * (512 + 64)  # kv_a_proj_with_mqa: latent 512 + RoPE key 64
        + 512  # kv_a_layernorm
        + 512 * heads * (128 + 128)  # kv_b_proj: W_UK (128) and W_UV (128) per head
        + heads * 128 * hidden  # o_proj
    )
    norms = 2 * hidden
    dense_mlp = 3 * hidden * 10944  # layer 0 (first_k_dense_replace = 1)
    moe = 64 * 3 * hidden * 1408 + 3 * hidden * 2 * 1408 + 64 * hidden  # routed, 2 shared, router
    total = 2 * embed + 27 * (attention + norms) + dense_mlp + 26 * moe + hidden
    assert total == 15_706_484_224  # the published "15.7B"
    counts = param_counts(config_from_file(CONFIGS / "deepseek-v2-lite.json"))
    assert counts.total == total
    assert counts.weight_bytes("bfloat16") == 2 * total  # 31.4 GB: one H200


def test_smol_mla_parameters_by_hand():
    """The SmolLM2-MLA testbed (its committed config.json): 9 heads of 64 + 64, d_c 256, dense MLPs,
    `lm_head` written untied (180.5M; the GQA source has 134.5M)."""
    hidden, vocab, heads = 576, 49152, 9
    attention = (
        hidden * heads * (64 + 64)  # q_proj: NoPE 64 + RoPE 64 per head
        + hidden * (256 + 64)  # kv_a_proj_with_mqa
        + 256  # kv_a_layernorm
        + 256 * heads * (64 + 64)  # kv_b_proj
        + heads * 64 * hidden  # o_proj
    )
    layer = attention + 3 * hidden * 1536 + 2 * hidden
    total = 2 * vocab * hidden + 30 * layer + hidden
    assert total == 180_528_960
    config = config_from_file(REPO / "assets" / "smol-mla" / "config.json")
    assert param_counts(config).total == total


def test_deepseek_v3_parameters_fp8_bytes_and_blocks_by_hand():
    hidden, vocab, heads = 7168, 129280, 128
    embed = vocab * hidden
    attention = [  # (rows, cols) of every projection: q_a, q_b, kv_a, kv_b, o
        (1536, hidden),
        (heads * (128 + 64), 1536),
        (512 + 64, hidden),
        (heads * (128 + 128), 512),
        (hidden, heads * 128),
    ]
    dense = [(18432, hidden), (18432, hidden), (hidden, 18432)]
    expert = [(2 * 2048, hidden), (hidden, 2048)]  # gate+up fused, down
    shared = [(2048, hidden), (2048, hidden), (hidden, 2048)]
    size = lambda ms: sum(r * c for r, c in ms)  # noqa: E731
    blocks = lambda ms: sum(-(-r // 128) * -(-c // 128) for r, c in ms)  # noqa: E731
    small = 2 * hidden + 1536 + 512  # per layer: two norms, q_a_layernorm, kv_a_layernorm
    router = 256 * hidden  # e_score_correction_bias is a buffer, not a parameter
    eligible = 61 * size(attention) + 3 * size(dense) + 58 * (256 * size(expert) + size(shared))
    total = eligible + 2 * embed + 61 * small + 58 * router + hidden
    assert total == 671_026_404_352  # the published "671B" (the 14B MTP module is not loaded)
    n_blocks = (
        61 * blocks(attention) + 3 * blocks(dense) + 58 * (256 * blocks(expert) + blocks(shared))
    )
    counts = param_counts(config_from_file(CONFIGS / "deepseek-v3-base.json"))
    assert (counts.total, counts.fp8_eligible, counts.fp8_blocks) == (total, eligible, n_blocks)
    fp8 = eligible + 4 * n_blocks + 2 * (total - eligible)
    assert counts.weight_bytes("bfloat16", fp8=True) == fp8
    assert 673.0e9 < fp8 < 673.5e9 < 8 * 137e9 < counts.weight_bytes("bfloat16")  # 1.34 TB


def test_longcat_flash_lite_parameters_by_hand():
    """What the checkpoint holds: the n-gram tables and projections, 28 MLA blocks with their dense
    MLPs, 14 MoE layers whose 256 routed experts have weights and 128 zero experts none."""
    hidden, vocab, heads = 3072, 131072, 32
    tables = [78 * vocab + 2 * i + 1 for i in range(12)]  # 4 splits × orders 2..4, odd moduli
    ngram = sum(rows * 256 for rows in tables) + 12 * hidden * 256  # tables + bias-free projections
    block = (
        1536 * hidden + 1536  # q_a_proj, q_a_layernorm
        + heads * (128 + 64) * 1536  # q_b_proj
        + (512 + 64) * hidden + 512  # kv_a_proj_with_mqa, kv_a_layernorm
        + heads * (128 + 128) * 512  # kv_b_proj
        + hidden * heads * 128  # o_proj
        + 2 * hidden  # input and post-attention norms
        + 3 * hidden * 6144  # the block's dense MLP
    )  # fmt: skip
    moe = 256 * 3 * 1024 * hidden + (256 + 128) * hidden  # routed experts, router over 384
    total = 2 * vocab * hidden + hidden + ngram + 28 * block + 14 * moe
    counts = param_counts(config_from_file(CONFIGS / "longcat-flash-lite.json"))
    assert counts.total == total
    assert abs(total - 68.5e9) <= 0.01 * 68.5e9  # the model card's 68.5B
    assert ngram > 30e9  # "over 30B of them in the n-gram embedding"
    assert counts.weight_bytes("bfloat16") > 141e9 - 4e9  # BF16 needs a second H200


def _plan(*overrides):
    proc = subprocess.run(
        [sys.executable, "-m", "quantmla.plan", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return {
        line.split(" | ")[0][2:]: line for line in proc.stdout.splitlines() if line.startswith("| ")
    }


@pytest.mark.parametrize(
    "launcher", [[], ["hydra/launcher=slurm_8gpu"]], ids=["default", "slurm_8gpu"]
)
def test_plan_of_the_sensitivity_sweep_on_one_8_gpu_node(launcher):
    rows = _plan("experiment=fig2_sensitivity", *launcher)
    for model in ("deepseek_v3_base", "deepseek_r1", "kimi_k2_instruct"):
        row = rows[f"{model} c4r4 rtn sensitivity"]
        assert "fp8 (E4M3 + block scales)" in row and row.endswith("| 8 | yes |"), row
    v3 = rows["deepseek_v3_base c4r4 rtn sensitivity"].split(" | ")
    assert v3[2] == "673.2" and v3[3] == "3.58"  # weights GB; capture 8 × 512 × 7168 × 2 B × 61
    lite = rows["deepseek_v2_lite c4r4 rtn sensitivity"].split(" | ")
    assert lite[1:3] == ["bfloat16", "31.4"]
    longcat = rows["longcat_flash_lite c4r4 rtn sensitivity"]  # the n-gram tables counted
    assert longcat.split(" | ")[1:3] == ["bfloat16", "137.1"] and longcat.endswith(
        "| 2 | 8 | yes |"
    )


def test_plan_without_fp8_native_does_not_fit_one_node():
    rows = _plan("experiment=fig2_sensitivity", "hydra/launcher=slurm_8gpu", "model.fp8=dequantize")
    assert rows["deepseek_v3_base c4r4 rtn sensitivity"].endswith("| 8 | **no** |")


@pytest.mark.parametrize(
    ("model", "launcher", "expected"),
    [
        ("deepseek_v3_base", "slurm_gpu", "a node with >= 5 GPUs"),
        ("kimi_k2_instruct", "slurm_gpu", "a node with >= 8 GPUs"),
    ],
)
def test_a_job_its_node_cannot_hold_is_refused_in_one_line(model, launcher, expected, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "quantmla.run",
            f"model={model}",
            "eval=sensitivity",
            "eval.datasets=[wikitext2]",
            f"hydra/launcher={launcher}",
            f"paths.results_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/out",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"hydra/launcher='{launcher}'" in lines[0] and expected in lines[0]


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_refuses_without_cuda_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: `make gpu-check` runs for real")
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: make gpu-check needs a CUDA device and none is visible here (on a CPU: make test)"
    ]


def test_gpu_check_job_runs_at_toy_size_on_cpu():
    """The GPU job's code path (random-init V2-Lite dims, C4R4, plan beside it) on CPU."""
    report = _gpu_check_module().perplexity_vs_plan("cpu", layers=2, seqlen=64, windows=2, batch=2)
    assert report["perplexity"] > 1 and report["plan_gpu_gb"] > report["plan_weights_gb"] > 0


@pytest.mark.parametrize(
    ("params", "overrides"),
    [
        ({"precision": "bf16,c2r4", "method": "quantmla,rtn"}, ["method=rtn"]),
        ({"precision": "bf16,c2r4"}, ["precision=c4r4", "precision.name=c16r4"]),
        ({"method": "quantmla,rtn"}, ["eval.limit=1,2", "precision.candidates=[c2r4,c4r4]"]),
        ({}, ["experiment=smol_table1"]),
    ],
)
def test_sweep_jobs_are_the_basic_sweepers(params, overrides):
    """The planner's jobs are the ones Hydra's basic sweeper launches (the command line's keys
    replace the experiment's sweep params; command-line sweeps multiply)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from quantmla.plan import sweep_jobs

    given = [f"{k}={v}" for k, v in params.items()] + overrides
    (reference,) = BasicSweeper.split_arguments(
        OverridesParser.create().parse_overrides(given), None
    )
    assert sweep_jobs(params, overrides) == reference


def test_a_precision_without_preset_does_not_multiply_an_experiments_sweep():
    from quantmla.cli import route_precision
    from quantmla.plan import sweep_jobs

    swept = {"precision": "bf16,c2r4,c4r4", "method": "quantmla,rtn"}  # as smol_table1's
    jobs = sweep_jobs(swept, route_precision(["precision=c16r4", "method=rtn"]))
    assert len(jobs) == 1 and "precision.name=c16r4" in jobs[0]
    rows = _plan("experiment=smol_table1", "precision=c16r4", "method=rtn")
    assert list(rows) == ["job", "smol_mla c16r4 rtn perplexity"]  # the command line's method
