"""tilec.zoo: the named model shapes the tests and benchmarks build."""
import pytest

from tilec.zoo import make_model


def test_make_model_overrides_a_config_field():
    """An override replaces the named shape's field (16 query heads of head_dim 32: q_proj 512 x 256)."""
    model = make_model("llama-tiny", num_attention_heads=16)
    assert model.config.num_attention_heads == 16 and model.config.num_key_value_heads == 2
    assert tuple(model.model.layers[0].self_attn.q_proj.weight.shape) == (512, 256)


def test_make_model_names_an_unknown_field():
    with pytest.raises(KeyError, match=r"no config field\(s\) \['heads'\].*num_attention_heads"):
        make_model("llama-tiny", heads=3)
