"""tilec.zoo: the named model shapes the tests and benchmarks build."""
import pytest

from tilec.zoo import make_model, prefill


def test_make_model_overrides_a_config_field():
    """An override replaces the named shape's field (16 query heads of head_dim 32: q_proj 512 x 256)."""
    model = make_model("llama-tiny", num_attention_heads=16)
    assert model.config.num_attention_heads == 16 and model.config.num_key_value_heads == 2
    assert tuple(model.model.layers[0].self_attn.q_proj.weight.shape) == (512, 256)


def test_make_model_names_an_unknown_field():
    with pytest.raises(KeyError, match=r"no config field\(s\) \['heads'\].*num_attention_heads"):
        make_model("llama-tiny", heads=3)


@pytest.mark.parametrize("call,error,message", [
    (dict(name="llama-7b"), KeyError, r"no model named 'llama-7b'; the zoo has \[.*'llama-tiny'"),
    (dict(name="llama-tiny", arch="qwen3"), KeyError, r"\['arch'\].*its architecture, llama, comes with the name"),
    (dict(name="llama-tiny", layers=1, num_hidden_layers=3), ValueError, "layer count given twice"),
    (dict(name="llama-tiny", layers=0), ValueError, "0 layers; at least 1"),
    (dict(name="llama-tiny", num_key_value_heads=3), ValueError, "8 query heads are not a multiple of 3 KV heads"),
    (dict(name="llama-tiny", dtype="bfloat16"), TypeError, "dtype must be a torch.dtype.*'bfloat16'"),
    (dict(name="llama-tiny", dtype="cpu"), TypeError, "dtype must be a torch.dtype.*'cpu'"),  # a device in its place
])
def test_make_model_refuses_bad_shapes(call, error, message):
    with pytest.raises(error, match=message):
        make_model(**call)


def test_prefill_longer_than_the_cache_is_a_clear_error():
    """It was torch's IndexError from inside HF's cache update (a fresh user's finding)."""
    model = make_model("llama-tiny")
    with pytest.raises(ValueError, match=r"prefill of 40 positions into a cache of 32: need 0 < context <= "
                                         r"max_cache_len"):
        prefill(model, 1, 40, 32)
