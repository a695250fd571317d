"""XLSERVE_QUANTIZE: its forms, what the engine process refuses at start-up, and the /v1/models
card of a quantized model (models/quantize.py; tests/models/test_quantize.py has the quality)."""

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from xlserve.models.quantize import QuantizationError, quantization_of, quantize_model
from xlserve.models.transformer_xl import TransformerXL, TransformerXLConfig
from xlserve.server.engine.process import load_models, model_card
from xlserve.server.metrics import Metrics
from xlserve.server.settings import EngineSettings, parse_quantize


def small_transformer_xl() -> TransformerXL:
    torch.manual_seed(0)
    config = TransformerXLConfig(vocab_size=256, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=8)
    return TransformerXL(config).eval()


def test_the_setting_names_one_mode_or_one_per_model():
    assert parse_quantize("") == parse_quantize("none") == {"": "none"}
    assert parse_quantize("int8") == {"": "int8"}
    assert parse_quantize(" a=int8, b = none ") == {"a": "int8", "b": "none"}
    settings = EngineSettings(quantize="a=int8")
    assert (settings.quantize_for("a"), settings.quantize_for("b")) == ("int8", "none")
    assert EngineSettings(quantize="int8").quantize_for("anything") == "int8"
    for wrong in ("int4", "a=int4", "a", "=int8"):
        with pytest.raises(ValidationError, match="quantize"):
            EngineSettings(quantize=wrong)


def test_a_name_that_is_not_served_stops_the_start():
    settings = EngineSettings(models="transformer-xl-stdlib", quantize="transformer-xl=int8", device="cpu")
    with pytest.raises(QuantizationError, match="'transformer-xl', which is not a served model"):
        load_models(settings, Metrics(), sink=lambda events: None)


def test_the_card_says_the_model_is_quantized():
    model = small_transformer_xl()
    plain = model_card(SimpleNamespace(name="m", model=model), 0)
    card = model_card(SimpleNamespace(name="m", model=quantize_model(small_transformer_xl(), "int8")), 0)
    assert (plain["quantize"], card["quantize"]) == ("none", "int8")
    assert card["parameters"] == plain["parameters"] and card["weight_bytes"] < plain["weight_bytes"]
    assert quantization_of(model) == "none"
