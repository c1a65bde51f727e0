"""`python -m quantmla.convert SRC OUT --kv-lora-rank N`: a Llama/Mistral-layout GQA checkpoint
converted into DeepSeek-V2's MLA layout (quantmla.models.conversion), saved as a plain checkpoint
that transformers' `DeepseekV2*` classes and vLLM load with no custom code.

SRC is a checkpoint folder, or a `.gguf` file (dequantized by transformers; needs `gguf`).
Calibration text: windows of the C4 sample's train slice (never an evaluation split).
`conversion.json` beside `config.json` says per layer how much key energy the shared RoPE key
holds and how much of [residual keys; values] the latent keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def load_source(src: Path, trust_remote_code: bool = False):
    """The source model (float32, eval) and its tokenizer, from a folder or a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.errors import DataNotFoundError

    if not src.exists():
        raise DataNotFoundError(f"SRC={str(src)!r}: no such file or folder")
    extra = {"gguf_file": src.name} if src.suffix == ".gguf" else {}
    folder = src.parent if extra else src
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, trust_remote_code=trust_remote_code, **extra
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **extra)
    model.config.quantization_config = None
    return model.eval(), tokenizer


def convert(args) -> Path:
    from tqdm.auto import tqdm

    from quantmla.checkpoint import save_untied
    from quantmla.data import calibration_split, load_text, tokenize
    from quantmla.errors import ConfigError
    from quantmla.models.conversion import attention_input_moments, check_source, convert_model

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError("OUT", str(out), "a new or empty folder (or --overwrite)")
    start = time.time()
    source, tokenizer = load_source(Path(args.src), args.trust_remote_code)
    check_source(source.config)
    ids = tokenize(load_text("c4", "train", args.data_dir), tokenizer)
    windows = calibration_split(
        ids, args.calibration_windows, 0, args.seqlen, args.seed
    ).calibration
    with tqdm(total=len(windows), desc="Σ_x (calibration windows)") as bar:
        sigmas = attention_input_moments(source, windows, progress=lambda: bar.update(1))
    model, plans = convert_model(source, sigmas, args.kv_lora_rank, args.metric)
    save_untied(model, tokenizer, out)
    report = {
        "source": str(args.src),
        "kv_lora_rank": args.kv_lora_rank,
        "metric": args.metric,
        "calibration": {
            "dataset": "c4/train",
            "windows": args.calibration_windows,
            "seqlen": args.seqlen,
            "seed": args.seed,
        },
        "layers": [
            {
                "rope_energy_kept": round(p.rope_energy_kept, 6),
                "latent_energy_kept": round(p.latent_energy_kept, 6),
            }
            for p in plans
        ],
        "seconds": round(time.time() - start, 1),
    }
    (out / "conversion.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"[quantmla] converted {args.src} to {out} (d_c {args.kv_lora_rank}) in {report['seconds']} s"
    )
    return out


def parser() -> argparse.ArgumentParser:
    from quantmla.models.conversion import METRICS

    p = argparse.ArgumentParser(
        prog="python -m quantmla.convert", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("src", help="source checkpoint folder or .gguf file")
    p.add_argument("out", help="folder for the converted checkpoint")
    p.add_argument(
        "--kv-lora-rank",
        type=int,
        default=256,
        help="latent width d_c (vLLM accepts d_c + d_r of 320, 512, 576)",
    )
    p.add_argument("--metric", choices=METRICS, default="output", help="joint-PCA metric")
    p.add_argument("--calibration-windows", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data-dir",
        default=None,
        help="local data folder (default $QUANTMLA_DATA_DIR, else the hub)",
    )
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    from quantmla.errors import QuantMLAError

    args = parser().parse_args(argv)
    try:
        convert(args)
    except QuantMLAError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
