"""Every bad input stops with one line naming the field, the value and what is allowed."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from quantmla.config import RunConfig
from quantmla.data import load_text
from quantmla.errors import QuantMLAError
from quantmla.job import resolve as validate
from quantmla.models.adapters import get_adapter
from quantmla.models.loading import config_from_dict, load_pretrained
from quantmla.policy import CachePolicy
from quantmla.quant import quantize_dequantize
from quantmla.simulator import patch_model
from quantmla.spec import parse_precision
from tests.conftest import MODEL_CONFIGS


def run_config(**overrides) -> RunConfig:
    base = OmegaConf.structured(RunConfig)
    return OmegaConf.to_object(
        OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    )


def tiny_checkpoint(tmp_path, **changes):
    raw = (
        json.loads(MODEL_CONFIGS[0].read_text()) if MODEL_CONFIGS else {"model_type": "deepseek_v3"}
    )
    raw.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


CASES = {
    "unknown model_type": (
        lambda tmp: get_adapter(type("C", (), {"model_type": "llama"})),
        "model_type='llama'",
    ),
    "unknown model_type in config.json": (
        lambda tmp: config_from_dict({"model_type": "mistral"}),
        "model_type='mistral'",
    ),
    "precision does not parse": (lambda tmp: parse_precision("int4"), "precision='int4'"),
    "precision bits out of range": (lambda tmp: parse_precision("c9r4"), "precision='c9r4'"),
    "precision bits zero": (lambda tmp: parse_precision("c0r4"), "precision='c0r4'"),
    "quantizer bits out of range": (
        lambda tmp: quantize_dequantize(torch.randn(64), 12),
        "bits=12",
    ),
    "negative recent": (lambda tmp: CachePolicy("c4r4", recent=-1), "recent=-1"),
    "unknown form": (lambda tmp: CachePolicy("c4r4", form="fused"), "form='fused'"),
    "group size not dividing d_r (config)": (
        lambda tmp: validate(
            run_config(
                **{
                    "model.path": tiny_checkpoint(tmp),
                    "precision.group_size": 48,
                    "paths.data_dir": "null",
                }
            )
        ),
        "group_size=48",
    ),
    "missing checkpoint": (
        lambda tmp: validate(run_config(**{"model.path": "/nonexistent/ckpt"})),
        "model.path='/nonexistent/ckpt'",
    ),
    "missing checkpoint (loader)": (
        lambda tmp: load_pretrained("/nonexistent/ckpt"),
        "model.path='/nonexistent/ckpt'",
    ),
    "testbed not built": (
        lambda tmp: validate(
            run_config(**{"model.path": str(tmp / "smol-mla"), "model.build": "make testbed-smol"})
        ),
        "not built yet",
    ),
    "missing data dir": (
        lambda tmp: load_text("wikitext2", "test", "/nonexistent/data"),
        "paths.data_dir='/nonexistent/data'",
    ),
    "missing data file": (
        lambda tmp: load_text("wikitext2", "test", str(tmp)),
        "wikitext2/test: looked for",
    ),
    "unknown dataset": (lambda tmp: load_text("ptb", "test", str(tmp)), "data.dataset='ptb'"),
    "missing split": (
        lambda tmp: load_text("wikitext2", "train", str(tmp)),
        "split of wikitext2='train'",
    ),
    "unknown method": (
        lambda tmp: validate(run_config(**{"method.name": "gptq"})),
        "method.name='gptq'",
    ),
    "unknown RoPE objective": (
        lambda tmp: validate(
            run_config(**{"method.name": "quantmla", "method.calibration.rope_objective": "kl"})
        ),
        "method.calibration.rope_objective='kl'",
    ),
    "RoPE positions below the calibration length": (
        lambda tmp: validate(
            run_config(
                **{
                    "method.name": "quantmla",
                    "method.calibration.seqlen": 512,
                    "method.calibration.rope_positions": 300,
                }
            )  # fmt: skip
        ),
        "method.calibration.rope_positions=300",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_one_line_error(case, tmp_path):
    trigger, expected = CASES[case]
    with pytest.raises(QuantMLAError) as info:
        trigger(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert expected in message


def test_group_size_checked_against_model_dims():
    if not MODEL_CONFIGS:
        pytest.skip("no model configs")
    from quantmla.models.loading import random_model_from_config_file

    model = random_model_from_config_file(MODEL_CONFIGS[0], num_layers=1)
    with pytest.raises(QuantMLAError, match="group_size=128"):
        patch_model(model, "c4r4", group_size=128)  # 128 does not divide d_r = 64


def test_nonfinite_cache_stops_with_error():
    if not MODEL_CONFIGS:
        pytest.skip("no model configs")
    from quantmla.errors import NonFiniteCacheError
    from quantmla.models.loading import random_model_from_config_file

    model = random_model_from_config_file(MODEL_CONFIGS[0], num_layers=1)
    patch_model(model, "c4r4")
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = float("nan")
        with pytest.raises(
            NonFiniteCacheError, match=r"layer 0: cached c has NaN/Inf at token positions \[3\]"
        ):
            model(torch.tensor([[1, 2, 3, 7, 4]]))
