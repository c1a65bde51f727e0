"""Structured-config schemas of the Hydra app (`conf/`): schemas only (validation is
`quantmla.job`). Every field carries a one-line `help` (shown by `python -m quantmla.run --help`).
This module imports nothing heavy: `--help` and config errors answer in seconds.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass


def opt(default=MISSING, help: str = "", factory=None):  # noqa: A002
    """A dataclass field with a one-line description."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    name: str = opt("tiny_mla", "short name used in tables and tags")
    path: str = opt(
        "assets/tiny-mla", "checkpoint folder (relative to paths.checkpoints_dir) or hub id"
    )
    config: str | None = opt(None, "published config.json used before/without loading weights")
    dtype: str = opt("float32", "float32 | bfloat16 | float16 | auto")
    device: str = opt("cpu", "cpu | cuda | cuda:N | auto (shard over all GPUs)")
    eval_seqlen: int = opt(512, "perplexity window length (tokens)")
    trust_remote_code: bool = opt(
        False, "run a checkpoint's own modeling code (only if you trust it)"
    )
    fp8: str = opt(
        "dequantize",
        "FP8 block-quantized checkpoints: native (FP8 weights, CUDA) | dequantize (BF16 on load)",
    )
    build: str | None = opt(
        None, "the command that builds this checkpoint locally (a testbed rebuilt, not committed)"
    )


MIXED_FIELDS = (
    "budget_bytes", "candidates", "allocation_error", "sensitivity_experiment", "allocation_windows",
    "joint_top", "allocation_method",
)  # fmt: skip
ALLOCATION_ERRORS = ("response", "output", "loss")
ALLOCATION_METHODS = ("job", "rtn")
# mixed fields added after mixed records existed: left out of a record at their default (same hash)
MIXED_HASH_NEUTRAL = {"allocation_method": "job"}
MIXED_CANDIDATES = (
    "c2r2", "c2r4", "c3r4", "c4r2", "c4r4", "c4r8", "c8r4", "c8r8", "c2r16", "c4r16", "ce4m3r16", "bf16",
)  # fmt: skip


@dataclass
class PrecisionConfig:
    name: str = opt(
        "c4r4",
        "'bf16', 'c<x>r<y>' (content/RoPE bits, x, y in 1..8 or 16, or e4m3/e5m2) or 'mixed'",
    )
    sink: int = opt(4, "first tokens read unquantized (BF16 protection)")
    recent: int = opt(128, "most recent tokens read unquantized (BF16 protection)")
    group_size: int = opt(64, "quantization group along d_c and d_r")
    # name=mixed only (in no other record's config): one format per layer under a bytes budget
    budget_bytes: float | None = opt(
        None, "mixed: mean packed bytes per token and layer (memory model, protection excluded)"
    )
    candidates: list[str] = opt(
        help="mixed: the formats a layer may take",
        factory=lambda: list(MIXED_CANDIDATES),
    )
    allocation_error: str = opt(
        "response",
        "mixed: what a layer's format is predicted to cost: response (R_C, R_P from the sensitivity "
        "records × the format's cache NMSE after the method's transforms) | output (the layer's "
        "measured output NMSE at the format, after the method's transforms) | loss (that output "
        "NMSE × the layer's measured next-token KL per unit output NMSE)",
    )
    sensitivity_experiment: str = opt(
        "fig2_sensitivity", "mixed: the experiment whose sensitivity records give R_C, R_P"
    )
    allocation_windows: int = opt(
        8, "mixed: WikiText-2 valid windows (model.eval_seqlen) for each format's cache NMSE"
    )
    joint_top: int = opt(
        1,
        "mixed: the error model's k best allocations are run whole on the allocation windows and "
        "the one with the lowest next-token KL to BF16 is taken (1: the error model's optimum)",
    )
    allocation_method: str = opt(
        "job",
        "mixed: the method the candidates' errors are measured under: job (the job's own at every "
        "candidate; QuantMLA calibrates once per candidate) | rtn (no transforms; the job's method "
        "then calibrates once, at the chosen allocation)",
    )


@dataclass
class CacheConfig:
    backend: str = opt(
        "simulator", "simulator | packed (paged packed cache + kernels; same function)"
    )
    kernel: str = opt(
        "auto", "packed backend kernels: auto (Triton on CUDA) | torch (the CPU path) | triton"
    )


@dataclass
class CalibrationConfig:
    """Calibration data and optimisation (SmoothQuant†, QuantMLA); the only place their defaults live."""

    dataset: str = opt("wikitext2", "calibration text")
    split: str = opt("valid", "WikiText-2 train is not available here: calibrate on valid")
    n_calibration: int = opt(128, "calibration sequences (paper: 128)")
    n_heldout: int = opt(32, "held-out sequences for α and checkpoint selection (paper: 32)")
    seqlen: int | None = opt(None, "calibration sequence length; null: model.eval_seqlen")
    capture_batch_size: int = opt(4, "sequences per teacher forward during capture")
    store_dir: str | None = opt(None, "memory-map captured activations here (large models)")
    alphas: list[float] = opt(
        help="initial-scale exponents searched per layer and path",
        factory=lambda: [0.125, 0.25, 0.5, 0.75, 1.0],
    )
    steps: int = opt(300, "QuantMLA optimisation steps")
    batch_size: int = opt(4, "sequences per step and per held-out batch")
    lr_rotation: float = opt(1e-3, "Adam learning rate of the Cayley parameters")
    lr_scale: float = opt(1e-2, "Adam learning rate of angles and log-scales")
    select_every: int = opt(25, "steps between held-out checkpoint selections")
    rope_objective: str = opt(
        "qk",
        "QuantMLA's RoPE-path target: qk = the positional QK-score error over all causal pairs "
        "(the paper's), output = the attention output with the RoPE path alone quantized (as "
        "the content path's; an extension)",
    )
    rope_positions: int = opt(
        0,
        "QuantMLA's RoPE objective sees each calibration and held-out sequence moved to a seeded "
        "start in [0, rope_positions - seqlen], so its fitted angles meet the key phases of every "
        "position below rope_positions (e.g. the evaluation's length; an extension). 0: the "
        "captured positions 0..seqlen-1 (the paper's)",
    )
    rope_hadamard: bool = opt(
        False,
        "QuantMLA / SmoothQuant†: a normalised Hadamard on the post-RoPE query and key after the "
        "fused per-pair transforms, run online as QuaRot†'s (fitted and α-searched with it; an "
        "extension: mixes the RoPE pairs, which no weight-fused transform can, so an export "
        "cannot carry it)",
    )
    reuse_units: bool = opt(
        True,
        "take each layer's content / RoPE transform an earlier artifact fitted at the same path "
        "format and settings instead of fitting it again (the same bits: units are separable)",
    )
    keep_teacher_outputs: bool = opt(
        True,
        "keep each sequence's teacher attention output after its first use (host memory: "
        "the captured inputs' size again) instead of recomputing it every step",
    )


@dataclass
class MethodConfig:
    name: str = opt("rtn", "rtn | smoothquant | quarot | quantmla")
    calibration: CalibrationConfig | None = opt(None, "calibration block (calibrated methods)")
    artifact: str | None = opt(None, "load this transform artifact instead of calibrating")


@dataclass
class PathsConfig:
    root: str | None = opt(None, "base of relative paths; null: the repository root (else cwd)")
    data_dir: str | None = opt(None, "local data folder; null: the hub ($QUANTMLA_DATA_DIR wins)")
    results_dir: str = opt(
        "results", "results store: <results_dir>/<experiment>/<hash>/result.json"
    )
    artifacts_dir: str | None = opt(None, "calibrated transforms; null: <results_dir>/artifacts")
    checkpoints_dir: str | None = opt(None, "base of a relative model.path; null: root")
    serve_python: str = opt(
        ".venv-serve/bin/python", "the serving venv's python (make serve-setup): vLLM runs there"
    )


@dataclass
class EvalConfig:
    kind: str = opt(
        "perplexity", "evaluator (quantmla.evaluation.registry; each kind reads its own fields)"
    )
    tasks: list[str] = opt(help="benchmark tasks (lm_eval / ruler kinds)", factory=list)
    context_lengths: list[int] = opt(help="ruler, memory, latency kinds", factory=list)
    datasets: list[str] = opt(help="perplexity datasets", factory=lambda: ["wikitext2", "c4"])
    splits: dict[str, str] = opt(
        help="split per dataset", factory=lambda: {"wikitext2": "test", "c4": "eval"}
    )
    max_windows: int | None = opt(None, "windows per dataset (null: all = the full evaluation)")
    batch_size: int = opt(4, "windows per forward; lm_eval / ruler (hf): requests per batch")
    compare_bf16: bool = opt(True, "also measure the unquantized model in the same job")
    nmse_windows: int = opt(8, "windows for per-layer attention-output NMSE (0: off)")
    # sensitivity / probes (one cell = one dataset in `datasets` × `seed`)
    paths: list[str] = opt(
        help="analysed cache paths: C (content), P (RoPE)", factory=lambda: ["C", "P"]
    )
    target_nmse: float = opt(
        0.01, "cache NMSE of the rescaled QDQ error (sensitivity 0.01, probes 1e-3)"
    )
    n_sequences: int = opt(8, "non-overlapping windows per cell")
    seqlen: int = opt(512, "tokens per window of a cell")
    layers: list[int] = opt(help="MLA layer indices to analyse (empty: all)", factory=list)
    probes: int = opt(256, "Rademacher probes per path (probes kind)")
    probe_chunk: int = opt(16, "probes per vmapped VJP batch (bounds memory)")
    interventions: int = opt(16, "draws per equal-energy intervention (probes kind)")
    # lm_eval / ruler
    limit: int | None = opt(
        None,
        "smoke/CPU knob: lm_eval: documents per task (lm-eval's --limit, per MMLU subject); "
        "ruler: samples per length (null: all / the paper's 500)",
    )
    data: str = opt(
        "local", "local: tasks with documents in paths.data_dir read them; hub: upstream"
    )
    max_gen_toks: int | None = opt(None, "generation budget for every generate task (null: task's)")
    apply_chat_template: bool = opt(False, "chat template (thinking disabled) for every prompt")
    prefix_cache: bool = opt(
        True,
        "lm_eval, hf engine: score a prompt's choices on one KV cache of their shared prefix "
        "(HFLM's scores up to float rounding; false: HFLM's batches)",
    )
    engine: str = opt(
        "hf",
        "lm_eval / ruler: hf (transformers + the job's cache, here) | vllm (lm-eval's vllm model "
        "on the job's export with the QuantMLA backend, in the serving venv)",
    )
    haystacks: list[str] = opt(
        help="retrieval kind: noise (our filler) and/or c4 (C4 evaluation slice)", factory=list
    )
    # throughput (Fig. 5c, through vLLM)
    requests: int = opt(5, "throughput: requests submitted at once")
    input_tokens: int = opt(2048, "throughput: prompt tokens per request")
    output_tokens: int = opt(1024, "throughput: greedy tokens per request")
    kv_cache_memory_bytes: int | None = opt(
        None, "throughput: the whole KV budget (protection included); null: vLLM's memory default"
    )
    max_num_seqs: int = opt(8, "throughput: vLLM's max_num_seqs (protection slots per layer)")
    max_num_batched_tokens: int | None = opt(
        None, "throughput: tokens per engine step (chunked prefill's chunk); null: vLLM's default"
    )
    first_chunk_admission: bool = opt(
        False,
        "throughput: admit a request once its first chunk fits (vLLM scheduler_reserve_full_isl="
        "False, the policy before vLLM reserved whole prompts), not only when its whole prompt does",
    )
    tensor_parallel: int = opt(1, "throughput: vLLM tensor_parallel_size")
    trial: int = opt(
        0,
        "throughput: which repeat of an otherwise identical job (0, 1, 2, ...): each keeps its "
        "record, tables show the median and min-max over repeats (0 is keyed as before repeats)",
    )


@dataclass
class LoggerConfig:
    name: str = opt("wandb", "wandb | none")
    project: str = opt("quantmla", "W&B project")
    entity: str | None = opt(None, "W&B entity")
    mode: str = opt("offline", "offline | online | disabled")


@dataclass
class RunConfig:
    model: ModelConfig = opt(help="the MLA model", factory=ModelConfig)
    precision: PrecisionConfig = opt(help="cache precision and protection", factory=PrecisionConfig)
    cache: CacheConfig = opt(
        help="which cache implementation generation runs on", factory=CacheConfig
    )
    method: MethodConfig = opt(help="quantization method", factory=MethodConfig)
    paths: PathsConfig = opt(
        help="data, results, artifacts, checkpoints roots", factory=PathsConfig
    )
    eval: EvalConfig = opt(help="what is measured", factory=EvalConfig)
    logger: LoggerConfig = opt(help="W&B mirror of the record", factory=LoggerConfig)
    experiment_name: str = opt("default", "results/<experiment_name>/...; W&B group")
    seed: int = opt(0, "seeds data sampling and calibration")
    force: bool = opt(
        False,
        "recompute the record even if one with this config hash exists (a calibrated method's matching artifact is loaded, not refitted)",
    )
    threads: int = opt(0, "torch CPU threads (0: torch's default)")


@dataclass
class GenerateConfig(RunConfig):
    """`python -m quantmla.generate`: a run config plus the prompt."""

    prompt: str = opt("The history of", "text to continue (greedy); any text, quoted for you")
    prompt_file: str | None = opt(None, "read the prompt from this file instead ('-': stdin)")
    max_new_tokens: int = opt(32, "tokens to generate")
    json_out: str | None = opt(None, "also write the continuation (text, token ids) as JSON here")


@dataclass
class ExportConfig(RunConfig):
    """`python -m quantmla.export`: a run config plus where the fused checkpoint goes."""

    out: str | None = opt(None, "folder of the exported checkpoint (must not exist, or be empty)")
    overwrite: bool = opt(False, "replace the files of an existing export in `out`")


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)
    ConfigStore.instance().store(name="export_schema", node=ExportConfig)


register_schemas()

DTYPES = ("float32", "bfloat16", "float16", "auto")
FP8_MODES = ("native", "dequantize")
ROPE_OBJECTIVES = ("qk", "output")
# calibration fields added after records and artifacts existed: hashed (a record's config, an
# artifact's fit settings) only off this default, so the earlier ones keep their keys
CALIBRATION_HASH_NEUTRAL = {"rope_objective": "qk", "rope_positions": 0, "rope_hadamard": False}


def calibration_seqlen(cfg) -> int:
    """Tokens per calibration sequence: `method.calibration.seqlen`, else `model.eval_seqlen`."""
    return cfg.method.calibration.seqlen or cfg.model.eval_seqlen


def calibrated_rope_online(calibration) -> str | None:
    """What a calibrated method runs online on the post-RoPE query and key (`rope_hadamard`)."""
    return "hadamard" if calibration.rope_hadamard else None


LOGGERS = ("wandb", "none")


def describe(schema=RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted field, default, help) for every leaf field of a schema, for `--help`."""
    rows = []
    for f in fields(schema):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if is_dataclass(default):
            rows += describe(type(default), f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", repr(default), f.metadata.get("help", "")))
    return rows
