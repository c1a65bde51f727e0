"""The second testbed's trainer (#13): exact warm start, deterministic batches with the right
targets, resume equal to an uninterrupted run, resume rules, bad config."""

import json
import re
from dataclasses import replace

import pytest
import torch

from experiments.train_tiny_mla_v2 import (
    Stage,
    TrainingData,
    TrainV2Config,
    V2ModelConfig,
    build_model,
    check_resume,
    lr_at,
    train,
    validate,
)
from quantmla.data.retrieval import varied_phrasing
from tests.conftest import DATA_DIR, TINY_MLA

pytestmark = pytest.mark.skipif(not DATA_DIR.is_dir(), reason="needs the shared data")

MICRO = V2ModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    kv_lora_rank=64,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    intermediate_size=128,
    max_position_embeddings=1024,
)


def micro_config(out_dir, **kw) -> TrainV2Config:
    fields = dict(
        data_dir=str(DATA_DIR),
        init_from=None,
        tokenizer=str(TINY_MLA),
        out_dir=str(out_dir),
        model=MICRO,
        stages=[Stage(2, 256, 2, 0.5), Stage(2, 320, 2, 1.0)],
        warmup_steps=1,
        eval_every=1000,
        eval_samples=1,
        log_every=1,
    )
    fields.update(kw)
    return TrainV2Config(**fields)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MLA)


@pytest.fixture(scope="module")
def data(tokenizer, tmp_path_factory):
    return TrainingData(micro_config(tmp_path_factory.mktemp("d")), tokenizer)


def test_warm_start_computes_the_tiny_model_exactly(tokenizer):
    """d_c 128 -> 256 by duplication, V3 (rope_interleave) -> V2 layout: same logits."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(TINY_MLA, dtype=torch.float32).eval()
    cfg = TrainV2Config(init_from=str(TINY_MLA), init_noise=0.0)
    new = build_model(cfg, tokenizer).eval()
    assert new.config.model_type == "deepseek_v2" and new.config.kv_lora_rank == 256
    ids = torch.randint(0, len(tokenizer), (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = old(ids).logits, new(ids).logits
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    noisy = build_model(replace(cfg, init_noise=0.02), tokenizer).eval()
    with torch.no_grad():
        assert not torch.equal(noisy(ids).logits, b)  # the duplicated channels are told apart


def test_batches_are_a_function_of_the_step_with_the_right_targets(data, tokenizer):
    ids, kinds = data.batch(3)
    again_ids, again_kinds = data.batch(3)
    assert torch.equal(ids, again_ids) and torch.equal(kinds, again_kinds)
    assert not torch.equal(data.batch(2)[0], ids)
    assert ids.shape == (2, 320)  # step 3 is in the second stage: all rows retrieval
    for row, kind in zip(ids.tolist(), kinds.tolist()):
        assert row[-1] == tokenizer.eos_token_id and kind[-1] == 2
        starts = [i for i in range(1, len(kind)) if kind[i] == 2 and kind[i - 1] != 2]
        assert starts and all(tokenizer.decode(row[:i]).endswith("\nAnswer:") for i in starts)
    text_rows = [k for k in data.batch(0)[1].tolist() + data.batch(1)[1].tolist() if 2 not in k]
    assert text_rows and all(set(k) == {1} for k in text_rows)


def test_batches_of_the_trained_stages_stay_as_trained(data):
    """Stages without the later knobs (restated answers, UUIDs, stage lr) draw exactly the batches
    they drew when the checkpoint's first 2,100 steps were trained (digest from that commit,
    71987ee), so `make train-tiny-v2` from scratch still reproduces them."""
    import copy
    import hashlib

    golden = copy.copy(data)
    golden.cfg = replace(
        data.cfg, stages=[Stage(2, 256, 4, 0.5, 0.0, 0.25), Stage(2, 512, 4, 0.75, 0.5, 0.1)]
    )
    h = hashlib.sha256()
    for step in range(4):
        ids, kinds = golden.batch(step)
        h.update(ids.numpy().tobytes())
        h.update(kinds.numpy().tobytes())
    assert h.hexdigest() == "757e787b8070f4aaaa91b4c93b9e1f4da50068360de211fbb1c7db56da7e4833"


def test_restate_and_uuid_stages_change_the_prompts_not_the_targets(data, tokenizer):
    import copy

    later = copy.copy(data)
    later.cfg = replace(data.cfg, stages=[Stage(3, 512, 8, 1.0, restate_share=1.0, uuid_share=1.0)])
    for step in range(3):
        ids, kinds = later.batch(step)
        for row, kind in zip(ids.tolist(), kinds.tolist()):
            starts = [i for i in range(1, len(kind)) if kind[i] == 2 and kind[i - 1] != 2]
            for i in starts:
                assert not tokenizer.decode(row[:i]).endswith("\nAnswer:")  # a restated lead
                end = next((j for j in range(i, len(kind)) if kind[j] != 2), len(kind))
                value = tokenizer.decode(row[i:end]).replace(tokenizer.eos_token, "").strip()
                assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", value), value


def test_varied_share_phrases_that_share_of_retrieval_rows_with_glue_words(data, monkeypatch):
    import copy

    import experiments.train_tiny_mla_v2 as trainer

    calls = []

    def spy(rng):
        calls.append(1)
        return varied_phrasing(rng)

    monkeypatch.setattr(trainer, "varied_phrasing", spy)
    later = copy.copy(data)
    for share, expected in ((1.0, 8), (0.0, 0)):
        calls.clear()
        later.cfg = replace(data.cfg, stages=[Stage(1, 512, 8, 1.0, varied_share=share)])
        later.batch(0)
        assert len(calls) == expected


def test_copy_rows_repeat_an_earlier_span_as_the_answer(data):
    import random

    for seed in range(5):
        row, kind = data.copy_row(256, random.Random(seed))
        n = kind.count(2)
        assert len(row) == len(kind) == 256 and 16 <= n <= 48 and kind[-n:] == [2] * n
        span, text = row[-n:], row[:-n]
        assert any(text[i : i + n] == span for i in range(len(text) - n + 1))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainV2Config(stages=[Stage(100, 64, 1, 0.0)], warmup_steps=10, lr=1e-3)
    assert lr_at(cfg, 0) == pytest.approx(1e-4) and lr_at(cfg, 9) == pytest.approx(1e-3)
    assert lr_at(cfg, 99) == pytest.approx(1e-4, rel=1e-2) and lr_at(cfg, 500) == pytest.approx(
        1e-4
    )
    later = replace(
        cfg, schedule_steps=100, stages=[Stage(100, 64, 1, 0.0), Stage(20, 64, 1, 0.0, lr=3e-4)]
    )
    assert lr_at(later, 50) == lr_at(cfg, 50)  # the cosine stages are unchanged
    assert lr_at(later, 100) == lr_at(later, 119) == lr_at(later, 500) == 3e-4


def _weights(out_dir):
    from safetensors.torch import load_file

    return load_file(out_dir / "model.safetensors")


def test_resume_equals_an_uninterrupted_run_and_follows_the_rules(tmp_path):
    """3 steps at once vs 3 stretches of one step each (checkpoint + reload between)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(micro_config(straight, stages=[Stage(3, 256, 2, 0.5)]))
    for _ in range(3):
        report = train(micro_config(resumed, stages=[Stage(3, 256, 2, 0.5)], max_minutes=0.0))
    assert report["steps"] == 3
    a, b = _weights(straight), _weights(resumed)
    for name in a:
        assert torch.allclose(a[name], b[name], atol=5e-5), name
    state = json.loads((resumed / "training_state" / "state.json").read_text())
    assert state["step"] == 3 and state["tokens"] == 3 * 2 * 256
    curve = (resumed / "training_curve.csv").read_text().splitlines()
    assert len(curve) == 4 and (resumed / "training_curve.png").is_file()

    saved = state["config"]
    later = micro_config(resumed, stages=[Stage(3, 256, 2, 0.5), Stage(2, 320, 2, 1.0)])
    check_resume(saved, replace(later, schedule_steps=3), 3)  # appended stage, same lr horizon
    with pytest.raises(ValueError, match="lr horizon"):
        check_resume(saved, later, 3)
    with pytest.raises(ValueError, match="stages change step 2"):
        check_resume(
            saved, micro_config(resumed, stages=[Stage(2, 256, 2, 0.5), Stage(1, 256, 4, 0.5)]), 3
        )
    with pytest.raises(ValueError, match="stages change step 0"):
        check_resume(saved, micro_config(resumed, stages=[Stage(3, 256, 2, 0.5, lr=1e-4)]), 3)
    with pytest.raises(ValueError, match="stages change step 0"):
        check_resume(
            saved, micro_config(resumed, stages=[Stage(3, 256, 2, 0.5, restate_share=0.5)]), 3
        )
    with pytest.raises(ValueError, match="stages change step 0"):
        check_resume(
            saved, micro_config(resumed, stages=[Stage(3, 256, 2, 0.5, varied_share=0.5)]), 3
        )
    with pytest.raises(ValueError, match="lr changed"):
        check_resume(saved, micro_config(resumed, stages=[Stage(3, 256, 2, 0.5)], lr=5e-4), 3)


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(stages=[]), "stages"),
        (dict(stages=[Stage(5, 8192, 1, 0.5)]), r"stages\[0\].seq_len"),
        (dict(stages=[Stage(5, 256, 1, 1.5)]), r"stages\[0\].retrieval_share"),
        (dict(stages=[Stage(5, 256, 1, 0.5, distractor_share=-1.0)]), "distractor_share"),
        (dict(stages=[Stage(5, 256, 1, 0.8, copy_share=0.3)]), "retrieval_share \\+ copy_share"),
        (dict(stages=[Stage(5, 256, 1, 0.5, restate_share=2.0)]), "restate_share"),
        (dict(stages=[Stage(5, 256, 1, 0.5, uuid_share=-0.1)]), "uuid_share"),
        (dict(stages=[Stage(5, 256, 1, 0.5, varied_share=1.5)]), "varied_share"),
        (dict(stages=[Stage(5, 256, 1, 0.5, lr=0.0)]), r"stages\[0\].lr"),
        (dict(filler_share=2.0), "filler_share"),
        (dict(schedule_steps=3), "schedule_steps"),
    ],
)
def test_bad_config_names_the_field(change, field):
    cfg = TrainV2Config(stages=[Stage(5, 256, 1, 0.5)])
    with pytest.raises(ValueError, match=field):
        validate(replace(cfg, **change))
