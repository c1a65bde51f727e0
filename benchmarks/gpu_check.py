"""`make gpu-check`: the project's first run on a GPU, as one command (< 8 min on one H200).

0. the kernels' ahead-of-time compile table (`make kernels-compile`) on the device, and the hot
   decode configurations launched for real beside what that table predicted;
1. the `gpu`-marked tests (Triton kernels against their references on CUDA, generation on the GPU
   against the CPU);
2. a perplexity job on a random-init model of DeepSeek-V2-Lite's published config (real MLA, MoE
   and vocabulary dims, `--layers` decoder layers) at C4R4 on CUDA, BF16, 2,048-token windows,
   with the memory plan's prediction (`quantmla.planning`) beside the measured peak;
3. the decode-latency `--quick` preset (`benchmarks/decode_latency.py`, fewer rounds).

Writes one JSON report (`--out`). Nothing is downloaded. Without CUDA it stops in one line.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "assets" / "model-configs" / "deepseek-v2-lite.json"


def perplexity_vs_plan(
    device: str, layers: int = 4, seqlen: int = 2048, windows: int = 8, batch: int = 4
) -> dict:
    """Perplexity of a random-init V2-Lite-dims model at C4R4 on `device`, and on CUDA its peak
    memory beside the plan's GPU bytes for the same job."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from quantmla import patch_model
    from quantmla.config import RunConfig
    from quantmla.evaluation.perplexity import perplexity
    from quantmla.models.loading import config_from_dict
    from quantmla.planning import GB, plan_job

    raw = json.loads(CONFIG.read_text())
    raw["num_hidden_layers"] = layers
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    cfg = OmegaConf.to_object(OmegaConf.structured(RunConfig))
    cfg.model.name, cfg.model.device, cfg.model.eval_seqlen = "deepseek_v2_lite", device, seqlen
    cfg.model.dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
    cfg.eval.batch_size = batch
    plan = plan_job(cfg, raw, gpus_available=1)
    torch.manual_seed(0)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config_from_dict(raw), dtype=dtype).eval()
    patch_model(model, "c4r4", sink=4, recent=128)
    ids = torch.randint(
        0, raw["vocab_size"], (windows, seqlen), generator=torch.Generator().manual_seed(0)
    )
    started = time.time()
    ppl = perplexity(model, ids, batch_size=batch, desc="gpu-check perplexity")
    report = {
        "device": device,
        "layers": layers,
        "windows": f"{windows} x {seqlen}",
        "perplexity": ppl,
        "seconds": time.time() - started,
        "plan_gpu_gb": plan.gpu_bytes / GB,
        "plan_weights_gb": plan.weights / GB,
    }
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() / GB
        report.update(measured_peak_gb=peak, peak_over_plan=peak / (plan.gpu_bytes / GB))
    return report


def _run(command: list[str], timeout: int) -> dict:
    started = time.time()
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as err:
        code, tail = 124, str(err)
    return {
        "command": " ".join(command),
        "rc": code,
        "seconds": time.time() - started,
        "tail": tail,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(REPO / "results" / "gpu_check.json"))
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "error: make gpu-check needs a CUDA device and none is visible here (on a CPU: make test)",
            file=sys.stderr,
        )
        sys.exit(2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    kernels = out.with_name("kernels_compile_device.json")
    report["kernels"] = _run(
        [sys.executable, "-m", "benchmarks.kernels_compile", "--device-check", "--jobs", "16",
         "--out", str(kernels)], 300,
    )  # fmt: skip
    if kernels.is_file():
        report["kernels"]["device_check"] = json.loads(kernels.read_text()).get("device_check")
    out.write_text(json.dumps(report, indent=1, default=str))
    report["gpu_tests"] = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"], 180)
    out.write_text(json.dumps(report, indent=1))  # partial results survive a later failure
    report["perplexity_job"] = perplexity_vs_plan("cuda", layers=args.layers)
    torch.cuda.empty_cache()
    out.write_text(json.dumps(report, indent=1))
    latency = out.with_name("decode_latency_quick.json")
    report["latency_quick"] = _run(
        [
            sys.executable,
            "benchmarks/decode_latency.py",
            "--quick",
            "--rounds",
            "3",
            "--reps",
            "50",
            "--out",
            str(latency),
        ],
        300,
    )
    if latency.is_file():
        report["latency_quick"]["results"] = json.loads(latency.read_text())
    serve = out.with_name("serve_decode.json")  # the vLLM backend's decode call (no vLLM needed)
    report["serve_decode"] = _run(
        [sys.executable, "benchmarks/serve_decode.py", "--rounds", "5", "--out", str(serve)], 180
    )
    if serve.is_file():
        report["serve_decode"]["results"] = json.loads(serve.read_text())
    out.write_text(json.dumps(report, indent=1, default=str))
    failed = [k for k in ("kernels", "gpu_tests", "latency_quick", "serve_decode")
              if report[k]["rc"] != 0]  # fmt: skip
    job = report["perplexity_job"]
    print(
        f"gpu-check on {report['device']}: gpu tests rc={report['gpu_tests']['rc']}; "
        f"perplexity {job['perplexity']:.1f} in {job['seconds']:.1f} s, peak {job['measured_peak_gb']:.1f} GB "
        f"vs plan {job['plan_gpu_gb']:.1f} GB; latency rc={report['latency_quick']['rc']}; report {out}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
