"""pipeoptim.models.hf_config (``pipeoptim train --hf-config/--hf-set``): a Hugging Face config from a file, a
folder or the local cache, changed by key=value, built on meta and cut; every wrong input refused, naming it."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from pipeoptim.models.hf_config import HFConfigError, build, resolve  # noqa: E402


@pytest.fixture
def qwen3(tmp_path):
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, vocab_size=151936, pad_token_id=151643)
    config.save_pretrained(tmp_path)
    return tmp_path


def test_a_config_file_or_folder_with_overrides_is_the_model_built_on_meta(qwen3):
    for where in (qwen3, qwen3 / "config.json"):
        spec = resolve(str(where), ["num_hidden_layers=3", "hidden_size=64", "vocab_size=300"])
        model = build(spec)
        assert type(model).__name__ == "Qwen3ForCausalLM" and all(p.is_meta for p in model.parameters())
        assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (3, 64, 300)
        assert len(model.config.layer_types) == 3  # drawn again for the new depth
        assert "layer_types recomputed for 3 layers" in spec["notes"]
    spec = resolve(str(qwen3))  # no --tokenizer: bytes
    assert spec["config"]["vocab_size"] == 256 and spec["config"]["pad_token_id"] is None
    assert any("pad_token_id 151643 is outside the vocabulary of 256" in n for n in spec["notes"])
    assert resolve(str(qwen3), vocab_size=1000)["config"]["vocab_size"] == 1000  # the tokenizer's


@pytest.mark.parametrize("item, message", [
    ("num_hiden_layers=3", r"the qwen3 config has no key 'num_hiden_layers' \(did you mean num_hidden_layers"),
    ("num_hidden_layers=two", r"num_hidden_layers is a whole number \(now 2\), not 'two'"),
    ("rms_norm_eps=small", r"rms_norm_eps is a number"),
    ("tie_word_embeddings=3", r"tie_word_embeddings is true or false"),
    ("hidden_size", r"write key=value"),
    ("num_hidden_layers=0", r"num_hidden_layers must be positive"),
    ("vocab_size=100", r"vocab_size=100: bytes need 256 token ids"),
    ("hidden_act=no_such_activation", r"--hf-set hidden_act=no_such_activation does not build a model"),
])
def test_a_bad_override_is_refused_naming_it(qwen3, item, message):
    with pytest.raises(HFConfigError, match=message):
        resolve(str(qwen3), [item])


def test_what_is_not_a_shipped_causal_lm_config_is_refused(tmp_path):
    with pytest.raises(HFConfigError, match="no such file or folder, and no model of that name in the local"):
        resolve(str(tmp_path / "nowhere"))
    with pytest.raises(HFConfigError, match="the folder has no config.json"):
        resolve(str(tmp_path))
    custom = tmp_path / "custom.json"
    custom.write_text(json.dumps({"model_type": "my_model", "auto_map": {"AutoConfig": "my.MyConfig"}}))
    with pytest.raises(HFConfigError, match=r"model_type 'my_model' needs custom code .*trust_remote_code=False"):
        resolve(str(custom))
    remote = tmp_path / "remote.json"  # a shipped model_type whose folder still asks for its own code
    remote.write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "m.M"}}))
    with pytest.raises(HFConfigError, match="its auto_map points at the model's own code"):
        resolve(str(remote))
    vit = tmp_path / "vit.json"
    vit.write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(HFConfigError, match="'vit' has no causal language model"):
        resolve(str(vit))
    (tmp_path / "nomodel.json").write_text("{}")
    with pytest.raises(HFConfigError, match="no model_type in it"):
        resolve(str(tmp_path / "nomodel.json"))


def test_a_model_the_cut_refuses_is_refused_with_the_cuts_reason(tmp_path):
    transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=2, output_router_logits=True,
                               vocab_size=256).save_pretrained(tmp_path)
    with pytest.raises(HFConfigError, match="output_router_logits=True adds the routers' auxiliary loss"):
        resolve(str(tmp_path))
