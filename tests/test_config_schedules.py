"""NoPE layer schedules (SmolLM3, Llama 4) read by RopeConfig.from_hf, against transformers' own modules.

The oracle is transformers: each attention module's ``use_rope`` (built from the same config by
``SmolLM3Attention`` / ``Llama4TextAttention``), Llama 4's ``layer_types`` (``chunked_attention`` on
the RoPE layers) and the temperature parameters its attention keeps. The schedule must agree for
the config object and for its ``config.json`` dict, and bad schedules must raise naming the key.
"""

import json

import pytest
import torch

from ropekit import LayerSchedule, RopeConfig
from ropekit.cli import inspect_json
from ropekit.cli.entry import main

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)

SMALL = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=64, intermediate_size=32,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA4_SMALL = dict(SMALL, head_dim=16, intermediate_size_mlp=32, num_local_experts=2)
SMOLLM3_CASES = {
    "default interval": dict(num_hidden_layers=8),
    "interval 3": dict(num_hidden_layers=7, no_rope_layer_interval=3),
    "listed": dict(num_hidden_layers=5, no_rope_layers=[0, 1, 1, 0, 1]),
    "all RoPE": dict(num_hidden_layers=3, no_rope_layers=[1, 1, 1]),
}
LLAMA4_CASES = {
    "default interval": dict(num_hidden_layers=8),
    "interval 2": dict(num_hidden_layers=6, no_rope_layer_interval=2),
    "empty list: the interval": dict(num_hidden_layers=5, no_rope_layers=[]),
    "listed": dict(num_hidden_layers=4, no_rope_layers=[1, 0, 0, 1]),
    "tuning off, no chunks": dict(num_hidden_layers=4, attn_temperature_tuning=False, attention_chunk_size=None),
    "own tuning": dict(num_hidden_layers=4, floor_scale=16, attn_scale=0.25, attention_chunk_size=32),
}


def attention_modules(model):
    return [layer.self_attn for layer in model.layers]


def built(config_class, model_class, kwargs):
    config = getattr(transformers, config_class)(**kwargs)
    with torch.device("meta"):  # nothing is computed: only the modules' attributes are read
        model = getattr(transformers, model_class)(config)
    return config, model


def same_schedule_from_object_and_dict(config):
    from_object = RopeConfig.from_hf(config).layer_schedule
    from_dict = RopeConfig.from_hf(json.loads(config.to_json_string())).layer_schedule
    assert from_object == from_dict
    return from_object


@pytest.mark.parametrize("case", sorted(SMOLLM3_CASES))
def test_smollm3_schedule_is_the_attention_modules_use_rope(case):
    config, model = built("SmolLM3Config", "SmolLM3Model", dict(SMALL, **SMOLLM3_CASES[case]))
    schedule = same_schedule_from_object_and_dict(config)
    assert schedule.rotary == tuple(bool(a.use_rope) for a in attention_modules(model))
    assert schedule.attention_chunk_size is None and schedule.temperature_tuning is None
    assert sorted(schedule.rope_layers + schedule.nope_layers) == list(range(config.num_hidden_layers))


@pytest.mark.parametrize("case", sorted(LLAMA4_CASES))
def test_llama4_schedule_chunks_and_temperature_are_transformers(case):
    config, model = built("Llama4TextConfig", "Llama4TextModel", dict(LLAMA4_SMALL, **LLAMA4_CASES[case]))
    schedule = same_schedule_from_object_and_dict(config)
    attention = attention_modules(model)
    assert schedule.rotary == tuple(bool(a.use_rope) for a in attention)
    # transformers' masks: chunked attention exactly on the RoPE layers
    assert [i for i, t in enumerate(config.layer_types) if t == "chunked_attention"] == list(schedule.rope_layers)
    assert schedule.attention_chunk_size == config.attention_chunk_size
    tuning = [(a.floor_scale, a.attn_scale) for a in attention if a.attn_temperature_tuning]
    assert schedule.temperature_tuning == (tuning[0] if tuning else None)


def test_multimodal_llama4_config_reads_its_text_config():
    config = transformers.Llama4Config(text_config=dict(LLAMA4_SMALL, num_hidden_layers=6, no_rope_layer_interval=3))
    schedule = same_schedule_from_object_and_dict(config)
    assert schedule.nope_layers == (2, 5)


def test_llama4_keys_left_out_take_transformers_defaults():
    cfg = {"model_type": "llama4_text", "head_dim": 16, "num_hidden_layers": 4}
    reference = transformers.Llama4TextConfig(num_hidden_layers=4)
    schedule = RopeConfig.from_hf(cfg).layer_schedule
    assert schedule.rotary == tuple(bool(x) for x in reference.no_rope_layers)
    assert schedule.attention_chunk_size == reference.attention_chunk_size
    assert schedule.temperature_tuning == (reference.floor_scale, reference.attn_scale)
    # a published checkpoint writes attn_temperature_tuning 4, which transformers' attention takes as true
    assert RopeConfig.from_hf({**cfg, "attn_temperature_tuning": 4}).layer_schedule == schedule
    # Meta's params.json name of the interval
    meta = RopeConfig.from_hf({**cfg, "nope_layer_interval": 2}).layer_schedule
    assert meta.nope_layers == (1, 3)


def test_models_without_a_schedule_have_none_and_other_models_with_a_list_are_read():
    assert RopeConfig.from_hf(transformers.LlamaConfig(**SMALL, num_hidden_layers=4)).layer_schedule is None
    assert RopeConfig(head_dim=64).layer_schedule is None
    other = {"model_type": "some_new_model", "head_dim": 16, "num_hidden_layers": 3, "no_rope_layers": [1, 0, 1]}
    assert RopeConfig.from_hf(other).layer_schedule == LayerSchedule((True, False, True))


@pytest.mark.parametrize("extra, words", [
    (dict(no_rope_layers=[1, 1, 0]), ["no_rope_layers", "3 entries", "num_hidden_layers is 4"]),
    (dict(no_rope_layers=[1, 1, 0, 1, 1]), ["no_rope_layers", "5 entries", "num_hidden_layers is 4"]),
    (dict(no_rope_layers=[]), ["no_rope_layers", "0 entries"]),  # SmolLM3: an empty list is not the interval
    (dict(no_rope_layers=[1, 2, 1, 1]), ["no_rope_layers[1]", "2"]),
    (dict(no_rope_layers=[1, 0.5, 1, 1]), ["no_rope_layers[1]", "0.5"]),
    (dict(no_rope_layers="1101"), ["no_rope_layers", "'1101'"]),
    (dict(no_rope_layer_interval=0), ["no_rope_layer_interval", "0"]),
    (dict(no_rope_layer_interval=True), ["no_rope_layer_interval", "True"]),
    (dict(no_rope_layer_interval=4, nope_layer_interval=2), ["no_rope_layer_interval=4", "nope_layer_interval=2"]),
    (dict(num_hidden_layers=None), ["num_hidden_layers", "None"]),
    (dict(num_hidden_layers=0), ["num_hidden_layers", "0"]),
])
def test_bad_smollm3_schedules_raise_naming_the_key(extra, words):
    cfg = {"model_type": "smollm3", "head_dim": 16, "num_hidden_layers": 4, **extra}
    with pytest.raises(ValueError) as info:
        RopeConfig.from_hf(cfg)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("extra, words", [
    (dict(no_rope_layers=[1, 1, 1]), ["no_rope_layers", "3 entries", "num_hidden_layers is 4"]),
    (dict(attention_chunk_size=0), ["attention_chunk_size", "0"]),
    (dict(floor_scale=0), ["floor_scale", "0"]),
    (dict(attn_scale=-0.1), ["attn_scale", "-0.1"]),
    (dict(attn_scale=None), ["attn_scale", "None"]),
])
def test_bad_llama4_schedules_raise_naming_the_key(extra, words):
    cfg = {"model_type": "llama4_text", "head_dim": 16, "num_hidden_layers": 4, **extra}
    with pytest.raises(ValueError) as info:
        RopeConfig.from_hf(cfg)
    for word in words:
        assert word in str(info.value)


def test_a_short_schedule_fails_in_transformers_too():
    """transformers fails on it as well, later (building the config) and without naming the key."""
    with pytest.raises(IndexError):
        transformers.SmolLM3Config(**SMALL, num_hidden_layers=4, no_rope_layers=[1, 1, 0])
    with pytest.raises(ValueError, match="no_rope_layers has 3 entries but num_hidden_layers is 4"):
        RopeConfig.from_hf({"model_type": "smollm3", "head_dim": 16, "num_hidden_layers": 4,
                            "no_rope_layers": [1, 1, 0]})


def test_layer_schedule_checks_its_arguments():
    schedule = LayerSchedule((True, True, False), attention_chunk_size=8, temperature_tuning=(8192, 0.1))
    assert (schedule.num_layers, schedule.rope_layers, schedule.nope_layers) == (3, (0, 1), (2,))
    assert schedule.rotates(1) and not schedule.rotates(2)
    assert LayerSchedule([True, False]).rotary == (True, False)  # a list becomes a tuple: hashable, frozen
    for bad in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match="layer must be an int in"):
            schedule.rotates(bad)
    with pytest.raises(ValueError, match="rotary"):
        LayerSchedule(())
    with pytest.raises(TypeError, match=r"rotary\[1\]"):
        LayerSchedule((True, 0))
    with pytest.raises(TypeError, match="rotary must be a sequence"):
        LayerSchedule(4)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        LayerSchedule((True,), attention_chunk_size=-8)
    with pytest.raises(ValueError, match="temperature_tuning"):
        LayerSchedule((True,), temperature_tuning=(8192,))
    with pytest.raises(ValueError, match="temperature_tuning"):
        LayerSchedule((True,), temperature_tuning=(8192, float("nan")))
    with pytest.raises(TypeError, match="layer_schedule"):
        RopeConfig(head_dim=64, layer_schedule=(True, False))


def test_inspect_shows_the_schedule():
    config = RopeConfig.from_hf(transformers.Llama4TextConfig(**LLAMA4_SMALL, num_hidden_layers=8))
    info = inspect_json.describe(config, bound=False)
    assert info["layer_schedule"] == {"layers": 8, "rope_layers": [0, 1, 2, 4, 5, 6], "nope_layers": [3, 7],
                                      "attention_chunk_size": 8192,
                                      "temperature_tuning": {"floor_scale": 8192, "attn_scale": 0.1}}
    assert inspect_json.describe(RopeConfig(head_dim=64), bound=False)["layer_schedule"] is None


def test_inspect_command_prints_the_schedule(tmp_path, capsys):
    path = tmp_path / "config.json"
    config = {"model_type": "smollm3", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 12}
    path.write_text(json.dumps({**config, "no_rope_layers": [1, 1, 0] * 4}))
    assert main(["inspect", "--config", str(path), "--no-bound"]) == 0
    assert "layers: 12; RoPE on 8, none (NoPE) on 4: 2, 5, 8, 11" in capsys.readouterr().out
    path.write_text(json.dumps({**config, "no_rope_layers": [1, 1, 0]}))
    assert main(["inspect", "--config", str(path), "--no-bound"]) == 2
    assert "no_rope_layers has 3 entries but num_hidden_layers is 12" in capsys.readouterr().err
