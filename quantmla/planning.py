"""Memory plans of jobs from their published configs alone (nothing downloaded or loaded): the
weights (FP8 block-quantized checkpoints at 1 B per weight + a float32 scale per 128 × 128 block
when `model.fp8=native`), the teacher capture (CPU RAM, or disk with `store_dir`), the GPU working
set (the larger of one whole-model forward — logits dominate — and one MLA layer's expanded
attention), the simulated KV cache at the job's lengths, and the GPUs that needs. Used by
`python -m quantmla.plan` and by validation, which refuses a SLURM job its node cannot hold."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

GPU_GB = float(os.environ.get("QUANTMLA_GPU_GB", "141"))  # H200; an 80 GB H100: 80
NODE_GPUS = int(os.environ.get("QUANTMLA_NODE_GPUS", "8"))  # one node, for model.device=auto
RESERVE_GB = 4.0  # per GPU: CUDA context, allocator slack
GB = 1e9


@dataclass(frozen=True)
class Plan:
    label: str
    weights_dtype: str
    weights: int
    capture: int  # CPU RAM (disk with store_dir)
    working: int  # GPU activations: max(forward, one layer's attention)
    kv_cache: int  # GPU
    gpus_needed: int
    gpus_available: int | None  # None: a CPU job

    @property
    def gpu_bytes(self) -> int:
        return self.weights + self.working + self.kv_cache

    @property
    def fits(self) -> bool | None:
        return None if self.gpus_available is None else self.gpus_needed <= self.gpus_available


@functools.cache
def _param_counts(raw_json: str):
    """One meta-device count per published config (a sweep plans each model's jobs many times)."""
    from quantmla.models.loading import config_from_dict
    from quantmla.models.sizes import param_counts

    return param_counts(config_from_dict(json.loads(raw_json)))


def default_gpus(cfg) -> int | None:
    """The GPUs a job asks for without a launcher: one node for `model.device=auto`, one GPU for
    `cuda`/`cuda:N`, none on a CPU."""
    device = cfg.model.device
    return NODE_GPUS if device == "auto" else (1 if device.startswith("cuda") else None)


def plan_job(cfg, raw_config: dict, gpus_available: int | None) -> Plan:
    """The memory plan of one job: `cfg` the run config, `raw_config` its published config.json;
    `gpus_available` the launcher node's GPUs (None: what `model.device` asks for)."""
    from quantmla.config import calibration_seqlen
    from quantmla.evaluation.registry import EVALUATORS
    from quantmla.models.loading import config_from_dict
    from quantmla.models.sizes import DTYPE_BYTES, is_fp8_checkpoint, mla_layer_count

    config = config_from_dict(raw_config)
    evaluator = EVALUATORS[cfg.eval.kind]
    native = is_fp8_checkpoint(raw_config) and cfg.model.fp8 == "native"
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16"
    act = DTYPE_BYTES[dtype]
    label = f"{cfg.model.name} {cfg.precision.name} {cfg.method.name} {cfg.eval.kind}"
    if not evaluator.needs_model:
        return Plan(label, "-", 0, 0, 0, 0, 0, None)
    counts = _param_counts(json.dumps(raw_config, sort_keys=True))
    weights = counts.weight_bytes(dtype, fp8=native)
    ev, layers = cfg.eval, mla_layer_count(config)
    hidden, heads, vocab = config.hidden_size, config.num_attention_heads, config.vocab_size
    d_c, d_r = config.kv_lora_rank, config.qk_rope_head_dim
    d_nope, d_v = config.qk_nope_head_dim, config.v_head_dim
    lengths = list(getattr(ev, "context_lengths", []) or [])
    batch = getattr(ev, "batch_size", 1)  # sequences per whole-model forward (capture too)
    if evaluator.layer_study:  # a layer's study runs on the whole cell
        tokens, cell = ev.seqlen, ev.n_sequences
    else:
        tokens, cell = max(lengths or [cfg.model.eval_seqlen]), batch
    # one forward: fp32 logits and their log-softmax, plus a few residual-stream tensors
    forward = batch * tokens * (2 * 4 * vocab + 6 * act * hidden)
    # one layer's expanded attention over two regions: fp32 scores + probabilities, K/V expanded
    attention = cell * heads * tokens * (2 * 4 * tokens + 2 * 4 * (d_nope + d_r + d_v))
    kv = 0
    if cfg.eval.kind in ("lm_eval", "ruler", "retrieval"):  # generation: raw + dequantized copies
        kv = 2 * batch * tokens * layers * (d_c + d_r) * act
    capture = 0
    if evaluator.layer_study:
        capture = ev.n_sequences * ev.seqlen * hidden * act * layers
    cal = cfg.method.calibration
    if cal is not None and not cfg.method.artifact and not cal.store_dir:
        seqlen = calibration_seqlen(cfg)
        capture = max(capture, (cal.n_calibration + cal.n_heldout) * seqlen * hidden * act * layers)
    working = max(forward, attention)
    usable = (GPU_GB - RESERVE_GB) * GB
    needed = max(1, math.ceil((weights + working + kv) / usable))
    if cfg.model.device == "cpu":
        available = None
    else:
        available = gpus_available if gpus_available is not None else default_gpus(cfg)
    return Plan(
        label,
        "fp8 (E4M3 + block scales)" if native else dtype,
        weights,
        capture,
        working,
        kv,
        needed,
        available,
    )


def launcher_gpus(hydra_cfg) -> tuple[str, int | None]:
    """(launcher name, GPUs of one node) of a composed Hydra config; None for a local launcher."""
    launcher = hydra_cfg.launcher
    target = str(launcher.get("_target_", ""))
    name = hydra_cfg.runtime.choices.get("hydra/launcher", target.rsplit(".", 1)[-1])
    if "submitit" in target and "slurm" in target.lower():
        return name, int(launcher.get("gpus_per_node") or 0)
    return name, None


def current_launcher() -> tuple[str, int | None] | None:
    """The running Hydra app's launcher, or None outside one (a library call, a test)."""
    from hydra.core.hydra_config import HydraConfig

    return launcher_gpus(HydraConfig.get()) if HydraConfig.initialized() else None


def check_fits(cfg, raw_config: dict, launcher: str, gpus: int) -> Plan:
    """One line if the job's GPU memory exceeds its launcher's node."""
    from quantmla.errors import ConfigError

    plan = plan_job(cfg, raw_config, gpus)
    if plan.fits is False:
        raise ConfigError(
            "hydra/launcher",
            launcher,
            f"a node with >= {plan.gpus_needed} GPUs of {GPU_GB:.0f} GB for {plan.label} "
            f"({plan.weights / GB:,.0f} GB {plan.weights_dtype} weights + "
            f"{(plan.working + plan.kv_cache) / GB:,.1f} GB working set; this node has {gpus}); "
            "see `python -m quantmla.plan`",
        )
    return plan
