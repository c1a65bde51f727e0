"""Train the second testbed (#13): a DeepSeek-V2-architecture MLA model at 2K context that retrieves.

    python -m experiments.train_tiny_mla_v2                       # train, or resume where it stopped
    python -m experiments.train_tiny_mla_v2 max_minutes=100       # one stretch (then run it again)
    python -m experiments.train_tiny_mla_v2 out_dir=/tmp/v2 stages='[{steps:3,seq_len:64,batch_size:2,retrieval_share:0.5}]'

Warm start from `assets/tiny-mla` (its latent duplicated to d_c 256: the same function, then a
little noise breaks the symmetry). Rows are C4-train/GSM8K-train text windows or retrieval documents
(`quantmla.data.retrieval`: C4-train or filler haystacks, training phrasings); a curriculum of
stages grows the context to 2,048. Batch `step` is a function of (seed, step) alone, so the data
position is the step. Every `checkpoint_minutes` (and at a stage end and the stretch's end) the
fp32 model, the AdamW moments (BF16) and the step go to `out_dir`; a rerun resumes from there.
A resume may change what lies ahead of the saved step (stages, stretch length), nothing behind it.
"""

from __future__ import annotations

import csv
import json
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from experiments.training import TinyModelConfig, adamw, training_documents, warmup_cosine
from quantmla.data import document_stream
from quantmla.data.retrieval import (
    RetrievalSampler,
    heldout_phrasing,
    training_phrasing,
    varied_phrasing,
)
from quantmla.evaluation.retrieval import accuracy


@dataclass
class V2ModelConfig(TinyModelConfig):
    kv_lora_rank: int = 256  # four content groups
    max_position_embeddings: int = 4096  # 4K RULER is defined


@dataclass
class Stage:
    steps: int
    seq_len: int
    batch_size: int
    retrieval_share: float  # fraction of rows that are retrieval documents
    distractor_share: float = 0.5  # retrieval rows with 1-3 more needles (each may be asked too)
    copy_share: float = 0.0  # rows of C4-train text ending in a repeat of one of their spans
    restate_share: float = 0.0  # retrieval rows answered after a restated lead (sampler `restate`)
    uuid_share: float = 0.0  # retrieval rows with UUID values (else number / word / hex)
    varied_share: float = 0.0  # retrieval rows phrased with arbitrary glue words (varied_phrasing)
    lr: float | None = None  # a constant lr for this stage (None: the cosine schedule)


@dataclass
class TrainV2Config:
    data_dir: str | None = None  # local data folder; None -> $QUANTMLA_DATA_DIR or the hub
    init_from: str | None = "assets/tiny-mla"  # warm start (tiny-mla layout); None: random init
    tokenizer: str = "assets/tiny-mla"
    out_dir: str = "assets/tiny-mla-v2"
    model: V2ModelConfig = field(default_factory=V2ModelConfig)
    stages: list[Stage] = field(default_factory=list)
    schedule_steps: int = 0  # the lr horizon (min lr after it); 0: the sum of the stages
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    answer_weight: float = 1.0  # loss = text mean + answer_weight * answer mean
    filler_share: float = 0.5  # retrieval rows with our filler haystack (else C4 train)
    init_noise: float = 0.02  # symmetry breaking of the duplicated latent, relative to row norm
    heldout_fraction: float = 0.02
    seed: int = 0
    threads: int = 2
    log_every: int = 10
    eval_every: int = 200
    eval_samples: int = 16
    checkpoint_minutes: float = 10.0
    max_minutes: float = 110.0  # this stretch's wall-clock budget; rerun to continue


ConfigStore.instance().store(name="train_tiny_mla_v2_schema", node=TrainV2Config)

# Fields a resume may change (they do not change what was trained before the saved step; the lr
# horizon, stages + schedule_steps, is checked on its own).
RESUMABLE = {"data_dir", "out_dir", "threads", "log_every", "eval_every", "eval_samples",
             "checkpoint_minutes", "max_minutes", "stages", "schedule_steps"}  # fmt: skip


def total_steps(cfg: TrainV2Config) -> int:
    return sum(s.steps for s in cfg.stages)


def stage_at(cfg: TrainV2Config, step: int) -> tuple[int, Stage]:
    end = 0
    for i, stage in enumerate(cfg.stages):
        end += stage.steps
        if step < end:
            return i, stage
    raise IndexError(f"step {step} is past the last stage ({end} steps)")


def lr_at(cfg: TrainV2Config, step: int) -> float:
    stage_lr = stage_at(cfg, min(step, total_steps(cfg) - 1))[1].lr
    if stage_lr is not None:
        return stage_lr
    horizon = cfg.schedule_steps or total_steps(cfg)
    return warmup_cosine(step, cfg.lr, cfg.warmup_steps, horizon, cfg.min_lr_ratio)


def validate(cfg: TrainV2Config) -> None:
    """One line naming the field before anything loads."""
    if not cfg.stages:
        raise ValueError("stages: give at least one {steps, seq_len, batch_size, retrieval_share}")
    for i, s in enumerate(cfg.stages):
        if s.steps < 1 or s.batch_size < 1:
            raise ValueError(f"stages[{i}]: steps and batch_size must be >= 1, got {s}")
        if s.lr is not None and not 0.0 < s.lr <= 1.0:
            raise ValueError(f"stages[{i}].lr={s.lr}: allowed (0, 1] or null (the cosine schedule)")
        for name in (f.name for f in fields(Stage) if f.name.endswith("_share")):
            if not 0.0 <= getattr(s, name) <= 1.0:
                raise ValueError(f"stages[{i}].{name}={getattr(s, name)}: allowed [0, 1]")
        if s.retrieval_share + s.copy_share > 1.0:
            raise ValueError(
                f"stages[{i}]: retrieval_share + copy_share = {s.retrieval_share + s.copy_share} > 1"
            )
        if not 256 <= s.seq_len <= cfg.model.max_position_embeddings:
            raise ValueError(
                f"stages[{i}].seq_len={s.seq_len}: allowed 256..{cfg.model.max_position_embeddings} "
                "(model.max_position_embeddings)"
            )
    if not 0.0 <= cfg.filler_share <= 1.0:
        raise ValueError(f"filler_share={cfg.filler_share}: allowed [0, 1]")
    if cfg.schedule_steps and cfg.schedule_steps <= cfg.warmup_steps:
        raise ValueError(
            f"schedule_steps={cfg.schedule_steps}: allowed 0 (the stages' sum) or > warmup_steps"
        )


class TrainingData:
    """Token streams (train / held-out documents) and the batch of any step, from (seed, step)."""

    def __init__(self, cfg: TrainV2Config, tokenizer):
        docs = training_documents(cfg.data_dir)
        order = list(range(len(docs)))
        random.Random(cfg.seed).shuffle(order)
        n_held = max(1, int(len(docs) * cfg.heldout_fraction))
        held, train = sorted(order[:n_held]), sorted(order[n_held:])
        self.cfg = cfg
        self.train = document_stream([docs[i] for i in train], tokenizer)
        self.heldout = document_stream([docs[i] for i in held], tokenizer)
        c4 = document_stream(
            [docs[i] for i in train if not docs[i].startswith("Question: ")], tokenizer
        )
        self.c4_sampler = RetrievalSampler(tokenizer, c4)
        self.filler_sampler = RetrievalSampler(tokenizer)

    def copy_row(self, seq_len: int, rng: random.Random) -> tuple[list[int], list[int]]:
        """C4-train text whose last n (16-48) tokens repeat an earlier span of the row: the repeat
        is an answer target (it teaches copying: induction heads, which retrieval builds on)."""
        n = rng.randint(16, min(48, seq_len // 4))
        start = rng.randrange(len(self.train) - seq_len)
        text = self.train[start : start + seq_len - n]
        at = rng.randrange(len(text) - n)
        return text + text[at : at + n], [1] * len(text) + [2] * n

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, kinds), both (batch, seq_len): kinds 1 = text target, 2 = answer target."""
        cfg = self.cfg
        _, stage = stage_at(cfg, step)
        rng = random.Random(cfg.seed * 1_000_003 + step)
        ids, kinds = [], []
        for _ in range(stage.batch_size):
            draw = rng.random()
            if draw < stage.retrieval_share:
                sampler = (
                    self.filler_sampler if rng.random() < cfg.filler_share else self.c4_sampler
                )
                distractors = rng.randint(1, 3) if rng.random() < stage.distractor_share else 0
                questions = rng.randint(1, distractors + 1)
                # later stages' draws only where they are on: earlier stages' batches stay as trained
                restate = stage.restate_share > 0 and rng.random() < stage.restate_share
                uuid_value = stage.uuid_share > 0 and rng.random() < stage.uuid_share
                varied = stage.varied_share > 0 and rng.random() < stage.varied_share
                s = sampler.sample(
                    stage.seq_len,
                    rng,
                    varied_phrasing if varied else training_phrasing,
                    style="uuid" if uuid_value else None,
                    distractors=distractors,
                    questions=questions,
                    restate=restate,
                )
                ids.append(s.ids)
                kinds.append(s.kinds)
            elif draw < stage.retrieval_share + stage.copy_share:
                row, kind = self.copy_row(stage.seq_len, rng)
                ids.append(row)
                kinds.append(kind)
            else:
                start = rng.randrange(len(self.train) - stage.seq_len)
                ids.append(self.train[start : start + stage.seq_len])
                kinds.append([1] * stage.seq_len)
        return torch.tensor(ids), torch.tensor(kinds)


def losses(model, ids: torch.Tensor, kinds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(text mean NLL, answer mean NLL) of next-token prediction; 0 where a kind is absent."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    target = kinds[:, 1:].flatten()
    out = []
    for kind in (1, 2):
        mask = target == kind
        out.append(nll[mask].mean() if mask.any() else nll.new_zeros(()))
    return out[0], out[1]


@torch.no_grad()
def heldout_loss(model, data: TrainingData, n: int = 16, seq_len: int = 512) -> float:
    stride = (len(data.heldout) - seq_len) // n
    ids = torch.tensor([data.heldout[i * stride : i * stride + seq_len] for i in range(n)])
    text, _ = losses(model, ids, torch.ones_like(ids))
    return float(text)


@torch.no_grad()
def retrieval_accuracy(model, sampler: RetrievalSampler, length: int, n: int, seed: int) -> float:
    """Greedy exact match (the value in the continuation) on held-out phrasings, 7-digit values."""
    rng = random.Random(seed)
    samples = [sampler.sample(length, rng, heldout_phrasing, "number7") for _ in range(n)]
    return accuracy(model, sampler.tokenizer, samples, max_new_tokens=8)


def build_model(cfg: TrainV2Config, tokenizer):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantmla.models.tiny import tiny_mla_v2_config, widen_latent_state

    config = tiny_mla_v2_config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **asdict(cfg.model),
    )
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if cfg.init_from:
        old = json.loads((Path(cfg.init_from) / "config.json").read_text())
        state = {
            k: v.float() for k, v in load_file(Path(cfg.init_from) / "model.safetensors").items()
        }
        state = widen_latent_state(state, old["kv_lora_rank"], cfg.model.kv_lora_rank)
        model.load_state_dict(state, strict=False)
        if cfg.init_noise:
            g = torch.Generator().manual_seed(cfg.seed)
            for layer in model.model.layers:
                w = layer.self_attn.kv_a_proj_with_mqa.weight.data[: cfg.model.kv_lora_rank]
                w += (
                    cfg.init_noise
                    * w.norm(dim=1, keepdim=True)
                    / w.shape[1] ** 0.5
                    * torch.randn(w.shape, generator=g)
                )
    return model


def make_optimizer(model, cfg: TrainV2Config) -> torch.optim.AdamW:
    return adamw(model, cfg.lr, cfg.weight_decay)


STATE = "training_state"


def save_checkpoint(model, tokenizer, opt, cfg: TrainV2Config, step: int, progress: dict) -> None:
    """fp32 model + tokenizer in out_dir; AdamW moments (BF16) and the step in out_dir/training_state."""
    from safetensors.torch import save_file

    out = Path(cfg.out_dir)
    (out / STATE).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                moments[f"{names[id(p)]}.exp_avg"] = st["exp_avg"].to(torch.bfloat16).contiguous()
                moments[f"{names[id(p)]}.exp_avg_sq"] = (
                    st["exp_avg_sq"].to(torch.bfloat16).contiguous()
                )
                adam_step = int(st["step"])
    save_file(moments, out / STATE / "optimizer.safetensors")
    record = {
        "step": step,
        "adam_step": adam_step if moments else 0,
        "config": _plain(cfg),
        **progress,
    }
    tmp = out / STATE / "state.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(out / STATE / "state.json")


def _plain(cfg: TrainV2Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def check_resume(saved: dict, cfg: TrainV2Config, step: int) -> None:
    """A resume may change only what lies ahead of the saved step."""
    now = _plain(cfg)
    for name, value in saved.items():
        if name not in RESUMABLE and now.get(name) != value:
            raise ValueError(
                f"resume: {name} changed ({value!r} -> {now.get(name)!r}); only {sorted(RESUMABLE)} may"
            )
    before = TrainV2Config(stages=[Stage(**s) for s in saved["stages"]])

    def shape(c, s):  # what a step trains on: every stage field but its length
        return {k: v for k, v in asdict(stage_at(c, s)[1]).items() if k != "steps"}

    for s in range(step):
        if shape(before, s) != shape(cfg, s):
            raise ValueError(
                f"resume: stages change step {s} < the saved step {step}; change only later stages"
            )
    if (cfg.schedule_steps or total_steps(cfg)) != (saved["schedule_steps"] or total_steps(before)):
        raise ValueError("resume: the lr horizon changed; set schedule_steps to keep it")


def load_checkpoint(model, opt, cfg: TrainV2Config) -> tuple[int, dict]:
    from safetensors.torch import load_file

    out = Path(cfg.out_dir)
    record = json.loads((out / STATE / "state.json").read_text())
    check_resume(record["config"], cfg, record["step"])
    model.load_state_dict(
        {k: v.float() for k, v in load_file(out / "model.safetensors").items()}, strict=False
    )
    moments = load_file(out / STATE / "optimizer.safetensors")
    if moments:
        for n, p in model.named_parameters():
            opt.state[p] = {
                "step": torch.tensor(float(record["adam_step"])),
                "exp_avg": moments[f"{n}.exp_avg"].float(),
                "exp_avg_sq": moments[f"{n}.exp_avg_sq"].float(),
            }
    return record["step"], {k: record[k] for k in ("minutes", "tokens")}


CURVE_FIELDS = ["step", "stage", "seq_len", "tokens", "minutes", "lr", "text_loss", "answer_loss",
                "heldout_loss", "retrieval_512", "retrieval_len"]  # fmt: skip


def append_curve(path: Path, row: dict) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, CURVE_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def plot_curve(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(path.open()))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))

    def series(key):
        pts = [(int(r["step"]), float(r[key])) for r in rows if r[key] not in ("", None)]
        return [p[0] for p in pts], [p[1] for p in pts]

    for key, label in (
        ("text_loss", "train text"),
        ("heldout_loss", "held-out text (512)"),
        ("answer_loss", "train answer"),
    ):
        a.plot(*series(key), label=label, lw=1)
    a.set_xlabel("step")
    a.set_ylabel("loss (nats/token)")
    a.legend()
    b.plot(*series("retrieval_512"), "o-", label="held-out phrasings, 512 tokens")
    b.plot(*series("retrieval_len"), "s-", label="held-out phrasings, stage length")
    b.set_xlabel("step")
    b.set_ylabel("greedy exact match (filler haystack)")
    b.set_ylim(-0.02, 1.02)
    b.legend()
    fig.suptitle("tiny-mla-v2 training")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110, metadata={"Software": None})
    plt.close(fig)


def train(cfg: TrainV2Config) -> dict:
    from transformers import AutoTokenizer

    validate(cfg)
    torch.set_num_threads(cfg.threads)
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    data = TrainingData(cfg, tokenizer)
    model = build_model(cfg, tokenizer)
    opt = make_optimizer(model, cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    step, progress = 0, {"minutes": 0.0, "tokens": 0}
    if (out / STATE / "state.json").exists():
        step, progress = load_checkpoint(model, opt, cfg)
        print(
            f"resumed at step {step} ({progress['minutes']:.1f} min, {progress['tokens']:,} tokens so far)"
        )
    n_params = sum(p.numel() for p in model.parameters())
    end = total_steps(cfg)
    print(f"{n_params:,} parameters; steps {step}..{end}")
    curve = out / "training_curve.csv"
    last_save = time.time()
    stretch_start, spent_before = time.time(), progress["minutes"]
    model.train()
    while step < end:
        stage_idx, stage = stage_at(cfg, step)
        ids, kinds = data.batch(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        text, answer = losses(model, ids, kinds)
        loss = text + cfg.answer_weight * answer
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        progress["tokens"] += ids.numel()
        progress["minutes"] = spent_before + (time.time() - stretch_start) / 60
        row = {}
        if step % cfg.log_every == 0:
            present = set(kinds[:, 1:].unique().tolist())  # a batch may lack text or answers
            row = {
                name: f"{value.item():.4f}" if kind in present else ""
                for name, value, kind in (("text_loss", text, 1), ("answer_loss", answer, 2))
            }
        if step % cfg.eval_every == 0 or step == end:
            model.eval()
            row["heldout_loss"] = f"{heldout_loss(model, data):.4f}"
            row["retrieval_512"] = (
                f"{retrieval_accuracy(model, data.filler_sampler, 512, cfg.eval_samples, 1):.3f}"
            )
            if stage.seq_len != 512:
                row["retrieval_len"] = (
                    f"{retrieval_accuracy(model, data.filler_sampler, stage.seq_len, cfg.eval_samples, 2):.3f}"
                )
            model.train()
        if row:
            row.update(step=step, stage=stage_idx, seq_len=stage.seq_len, tokens=progress["tokens"],
                       minutes=f"{progress['minutes']:.2f}", lr=f"{lr_at(cfg, step - 1):.2e}")  # fmt: skip
            append_curve(curve, row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        stage_end = step == end or stage_at(cfg, step)[0] != stage_idx
        out_of_time = (time.time() - stretch_start) / 60 >= cfg.max_minutes
        if stage_end or out_of_time or (time.time() - last_save) / 60 >= cfg.checkpoint_minutes:
            save_checkpoint(model, tokenizer, opt, cfg, step, progress)
            plot_curve(curve)
            last_save = time.time()
            print(f"checkpoint at step {step}", flush=True)
        if out_of_time:
            print(
                f"stretch budget max_minutes={cfg.max_minutes} spent: rerun the same command to resume"
            )
            break
    report = {
        "params": n_params,
        "steps": step,
        "of": end,
        **progress,
        "wall_minutes": (time.time() - started) / 60,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2))
    return report


@hydra.main(version_base=None, config_path="../conf", config_name="train_tiny_mla_v2")
def main(cfg) -> None:
    train(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
