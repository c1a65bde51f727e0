"""Heal the converted SmolLM2-MLA: make the MLA attention compute what the source's GQA attention did.

    python -m experiments.heal_smol_mla              # writes assets/smol-mla/{healed.safetensors,fingerprint.json,healing.json}

1. Convert (`quantmla.models.conversion`): Σ_x of every layer on C4-train windows, RoPE concentration,
   output-aware joint PCA to d_c 256, the latent norm in its linear regime.
2. Local phase, layer by layer: each converted attention, fed the source's own input to that layer,
   is trained to reproduce the source attention's output (relative MSE) — `kv_a_proj_with_mqa`,
   `kv_a_layernorm`, `kv_b_proj` in full and a rank-r delta of `q_proj`. Layers are independent
   given the captured inputs; the state is saved after each layer, and a rerun resumes.
3. Global phase: KL(source ‖ student) on next-token distributions, same parameters, checkpoint
   kept by held-out C4 perplexity (8 windows the training never sees; never a test set).
Text: the C4 sample's train slice only. What is trained is written in BF16 (the rebuild's
input, see experiments/smol_mla.py), and the fingerprint of the model rebuilt from it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from experiments.smol_mla import (
    ASSETS,
    CACHE,
    DATA_DIR,
    KV_LORA_RANK,
    fetch_source,
    fingerprint,
    load_source,
    rebuild,
)
from quantmla.data import calibration_split, load_text, tokenize
from quantmla.models.conversion import LINEAR_NORM_TAU, attention_input_moments, convert_model


@dataclass
class HealConfig:
    data_dir: str | None = DATA_DIR  # $QUANTMLA_DATA_DIR, else ../shared/data
    seqlen: int = 512
    calibration_windows: int = 32  # Σ_x for the conversion
    heal_windows: int = 64  # training windows (the calibration windows among them)
    heldout_windows: int = 8  # checkpoint selection
    delta_rank: int = 8
    local_steps: int = 150
    local_batch: int = 2
    local_lr: float = 3e-4
    global_minutes: float = 12.0
    global_lr: float = 5e-5
    global_eval_every: int = 20
    seed: int = 0

    def conversion_id(self) -> str:
        return (
            f"c4-train-{self.calibration_windows}x{self.seqlen}-seed{self.seed}-d_c{KV_LORA_RANK}"
        )


class RowScale(torch.nn.Module):
    """The first `rows` rows trained at unit scale, used at `scale` (the latent's τ√eps)."""

    def __init__(self, rows: int, scale: float):
        super().__init__()
        self.rows, self.scale = rows, scale

    def forward(self, w):
        return torch.cat([w[: self.rows] * self.scale, w[self.rows :]])

    def right_inverse(self, w):
        return torch.cat([w[: self.rows] / self.scale, w[self.rows :]])


class Scaled(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, w):
        return w * self.scale

    def right_inverse(self, w):
        return w / self.scale


class LowRankDelta(torch.nn.Module):
    """W = W₀ (frozen) + B·A, B initialised to zero."""

    def __init__(self, out_features: int, in_features: int, rank: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(
            torch.randn(rank, in_features, generator=g) / math.sqrt(in_features)
        )
        self.b = torch.nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, w):
        return w + self.b @ self.a


def make_trainable(attention, rank: int, seed: int) -> list[torch.nn.Parameter]:
    """Parametrize one converted attention for training; returns its trainable parameters."""
    for p in attention.parameters():
        p.requires_grad_(False)
    r = attention.kv_lora_rank
    eps = attention.kv_a_layernorm.variance_epsilon
    parametrize.register_parametrization(
        attention.kv_a_proj_with_mqa, "weight", RowScale(r, LINEAR_NORM_TAU * math.sqrt(eps))
    )
    parametrize.register_parametrization(
        attention.kv_a_layernorm, "weight", Scaled(1 / LINEAR_NORM_TAU)
    )
    q = attention.q_proj.weight
    parametrize.register_parametrization(
        attention.q_proj, "weight", LowRankDelta(*q.shape, rank, seed)
    )
    trainable = [
        attention.kv_a_proj_with_mqa.parametrizations.weight.original,
        attention.kv_a_layernorm.parametrizations.weight.original,
        attention.kv_b_proj.weight,
        *attention.q_proj.parametrizations.weight[0].parameters(),
    ]
    for p in trainable:
        p.requires_grad_(True)
    return trainable


@torch.no_grad()
def capture(source, windows: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's attention input and output in the source (BF16, to fit memory)."""
    layers = source.model.layers
    inputs = [[] for _ in layers]
    outputs = [[] for _ in layers]
    handles = []
    for i, block in enumerate(layers):

        def hook(_m, args, kwargs, out, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            inputs[i].append(x.detach().bfloat16())
            outputs[i].append(out[0].detach().bfloat16())

        handles.append(block.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        for row in windows:
            source(input_ids=row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(x) for x in inputs], [torch.cat(y) for y in outputs]


def attention_loss(attention, rotary, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None]
    out = attention(hidden_states=x, attention_mask=None, position_embeddings=rotary(x, positions))[
        0
    ]
    return (out - y).pow(2).mean() / y.pow(2).mean()


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    total = 0.0
    for row in windows:
        total += model(input_ids=row[None], labels=row[None], use_cache=False).loss.item()
    return math.exp(total / len(windows))


def export_tensors(student, plans) -> dict[str, torch.Tensor]:
    """What the rebuild needs: the head mixing (float64) and the trained tensors (BF16)."""
    out = {}
    for i, (block, plan) in enumerate(zip(student.model.layers, plans)):
        a, prefix = block.self_attn, f"model.layers.{i}.self_attn."
        delta = a.q_proj.parametrizations.weight[0]
        out[prefix + "rope_mixing"] = plan.mixing[:, 0, :].contiguous()
        out[prefix + "kv_a_proj_with_mqa.weight"] = a.kv_a_proj_with_mqa.weight.detach().bfloat16()
        out[prefix + "kv_a_layernorm.weight"] = a.kv_a_layernorm.weight.detach().float()
        out[prefix + "kv_b_proj.weight"] = a.kv_b_proj.weight.detach().bfloat16()
        out[prefix + "q_proj.delta_a"] = delta.a.detach().bfloat16()
        out[prefix + "q_proj.delta_b"] = delta.b.detach().bfloat16()
    return {k: v.contiguous() for k, v in out.items()}


def windows(tokenizer, cfg: HealConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(training windows, held-out windows) of the C4 sample's train slice; the first
    `calibration_windows` training windows give Σ_x."""
    ids = tokenize(load_text("c4", "train", cfg.data_dir), tokenizer)
    split = calibration_split(ids, cfg.heal_windows, cfg.heldout_windows, cfg.seqlen, cfg.seed)
    return split.calibration, split.heldout


def converted_model(source, tokenizer, cfg: HealConfig, state_dir: Path = CACHE / "healing"):
    """The converted model before healing (and its per-layer plans); Σ_x kept in `state_dir`."""
    state_dir.mkdir(parents=True, exist_ok=True)
    sigma_file = state_dir / f"sigma-{cfg.conversion_id()}.pt"
    if sigma_file.is_file():
        sigmas = torch.load(sigma_file, weights_only=True)
    else:
        train, _ = windows(tokenizer, cfg)
        sigmas = attention_input_moments(source, train[: cfg.calibration_windows])
        torch.save(sigmas, sigma_file)
    return convert_model(source, sigmas, KV_LORA_RANK)


def heal(cfg: HealConfig, assets: Path = ASSETS, state_dir: Path = CACHE / "healing") -> dict:
    from safetensors.torch import load_file, save_file

    state_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"config": asdict(cfg)}
    t0 = time.time()
    source, tokenizer = load_source(fetch_source())
    for p in source.parameters():
        p.requires_grad_(False)
    train, heldout = windows(tokenizer, cfg)
    student, plans = converted_model(source, tokenizer, cfg, state_dir)
    for p in student.parameters():
        p.requires_grad_(False)
    params = [
        make_trainable(b.self_attn, cfg.delta_rank, cfg.seed + i)
        for i, b in enumerate(student.model.layers)
    ]
    report["source_heldout_ppl"] = perplexity(source, heldout)
    report["converted_heldout_ppl"] = perplexity(student, heldout)
    print(
        f"held-out C4 ppl: source {report['source_heldout_ppl']:.3f}, converted {report['converted_heldout_ppl']:.3f}",
        flush=True,
    )

    local_file = state_dir / "local.pt"
    local = (
        torch.load(local_file, weights_only=True)
        if local_file.is_file()
        else {"done": 0, "params": [], "losses": []}
    )
    for i in range(local["done"]):
        for p, saved in zip(params[i], local["params"][i]):
            p.data.copy_(saved)
    if local["done"] < len(student.model.layers):
        xs, ys = capture(source, train)
        rotary = student.model.rotary_emb
        g = torch.Generator().manual_seed(cfg.seed)
        for i in range(local["done"], len(student.model.layers)):
            attention = student.model.layers[i].self_attn
            optimizer = torch.optim.Adam(params[i], lr=cfg.local_lr)
            first = None
            for step in range(cfg.local_steps):
                lr = cfg.local_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.local_steps))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                pick = torch.randint(0, train.shape[0], (cfg.local_batch,), generator=g)
                loss = attention_loss(attention, rotary, xs[i][pick].float(), ys[i][pick].float())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                first = loss.item() if first is None else first
            local["losses"].append([first, loss.item()])
            local["params"].append([p.detach().clone() for p in params[i]])
            local["done"] = i + 1
            torch.save(local, local_file)
            print(
                f"layer {i}: relative MSE {first:.4f} -> {loss.item():.4f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
        del xs, ys
    report["local_losses"] = local["losses"]
    report["local_heldout_ppl"] = perplexity(student, heldout)
    print(f"held-out C4 ppl after the local phase: {report['local_heldout_ppl']:.3f}", flush=True)

    flat = [p for group in params for p in group]
    best = {
        "ppl": report["local_heldout_ppl"],
        "step": 0,
        "params": [p.detach().clone() for p in flat],
    }
    optimizer = torch.optim.Adam(flat, lr=cfg.global_lr)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    start, step, curve = time.time(), 0, []
    while (elapsed := (time.time() - start) / (cfg.global_minutes * 60)) < 1:
        for group in optimizer.param_groups:  # cosine over the time budget
            group["lr"] = cfg.global_lr * 0.5 * (1 + math.cos(math.pi * elapsed))
        row = train[torch.randint(0, train.shape[0], (1,), generator=g)]
        with torch.no_grad():
            target = torch.log_softmax(source(input_ids=row, use_cache=False).logits.float(), -1)
        logp = torch.log_softmax(student(input_ids=row, use_cache=False).logits.float(), -1)
        loss = (
            torch.nn.functional.kl_div(logp, target, log_target=True, reduction="batchmean")
            / row.shape[1]
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % cfg.global_eval_every == 0:
            ppl = perplexity(student, heldout)
            curve.append([step, round(loss.item(), 5), round(ppl, 4)])
            print(
                f"global step {step}: KL {loss.item():.4f}, held-out ppl {ppl:.3f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
            if ppl < best["ppl"]:
                best = {"ppl": ppl, "step": step, "params": [p.detach().clone() for p in flat]}
    for p, saved in zip(flat, best["params"]):
        p.data.copy_(saved)
    report["global_curve"], report["global_best_step"] = curve, best["step"]

    assets.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(student, plans)
    save_file(tensors, str(assets / "healed.safetensors"))
    rebuilt = rebuild(source, load_file(str(assets / "healed.safetensors")))
    report["published_heldout_ppl"] = perplexity(rebuilt, heldout)
    report["minutes"] = round((time.time() - t0) / 60, 1)
    (assets / "fingerprint.json").write_text(
        json.dumps(fingerprint(rebuilt, tokenizer), indent=1) + "\n"
    )
    (assets / "healing.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"published: held-out C4 ppl {report['published_heldout_ppl']:.3f}; {report['minutes']} min",
        flush=True,
    )
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(HealConfig()).items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(value) if value is not None else str,
            default=value,
        )
    cfg = HealConfig(**vars(parser.parse_args(argv)))
    torch.set_num_threads(2)
    heal(cfg)


if __name__ == "__main__":
    main()
