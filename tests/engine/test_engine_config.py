"""EngineConfig: vLLM's names and defaults, vLLM's validation rules, a stable content hash."""
from __future__ import annotations

import json

import pytest

from engine.config import ConfigError, EngineConfig, SpeculativeConfig
from engine.tokens import count_tokens, synthetic_text


def test_defaults_resolve_like_vllm_v1_openai_server():
    h100 = EngineConfig().resolved()
    assert (h100.max_num_seqs, h100.max_num_batched_tokens, h100.max_model_len) == (1024, 8192, 131072)
    a100 = EngineConfig(gpu_type="A100-80GB").resolved()
    assert (a100.max_num_seqs, a100.max_num_batched_tokens) == (256, 2048)
    l4 = EngineConfig(gpu_type="L4").resolved()
    assert (l4.max_num_seqs, l4.max_num_batched_tokens) == (256, 2048)
    partial = EngineConfig(max_num_partial_prefills=4, max_long_partial_prefills=2).resolved()
    assert partial.long_prefill_token_threshold == int(131072 * 0.04)


def test_hash_names_the_resolved_config():
    assert EngineConfig().version == EngineConfig(max_num_seqs=1024, max_num_batched_tokens=8192).version
    assert EngineConfig().version != EngineConfig(max_num_seqs=256).version
    assert EngineConfig().version.startswith("cfg-") and len(EngineConfig().version) == 16
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    a = EngineConfig.from_dict({"speculative_config": spec, "block_size": 16})
    b = EngineConfig.from_dict({"block_size": 16, "speculative_config": {**spec, "prompt_lookup_max": 5}})
    assert a.version == b.version  # ngram's unset lookup window resolves to vLLM's 5/5
    assert EngineConfig.from_json(json.dumps(a.to_dict())).version == a.version


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "must be greater than or equal to max_num_seqs"),
        ({"max_num_partial_prefills": 2, "enable_chunked_prefill": False, "max_model_len": 4096,
          "max_num_batched_tokens": 8192}, "needs enable_chunked_prefill"),
        ({"enable_chunked_prefill": False}, "smaller than max_model_len"),
        ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "max_long_partial_prefills (3)"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),
        ({"block_size": 24}, "block_size"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"gpu_type": "TPU"}, "gpu_type"),
        ({"max_model_len": 500000}, "greater than the model's context length"),
        ({"max_num_seqs": "many"}, "max_num_seqs must be an integer"),
        ({"speculative_config": {"method": "eagle", "num_speculative_tokens": 3}}, "needs a draft model"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6,
                                 "prompt_lookup_max": 3}}, "prompt_lookup_min (6) must be <="),
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}},
         "only apply to method 'ngram'"),
        ({"speculative_config": {"method": "lookahead", "num_speculative_tokens": 2}}, "method must be one of"),
        ({"speculative_config": {"num_speculative_tokens": 2}}, "speculative_config.method is required"),
        ({"speculative_config": "ngram"}, "must be a mapping"),
        ({"max_num_seq": 4}, "unknown engine config key 'max_num_seq'"),
    ],
)
def test_refuses_what_vllm_refuses(data, needle):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(data)
    assert needle in str(info.value)


def test_every_problem_is_reported_at_once_and_replace_validates():
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"block_size": 3, "kv_cache_dtype": "x", "bogus": 1})
    assert len(info.value.problems) == 3
    config = EngineConfig()
    changed = config.replace(speculative_config={"method": "eagle3", "num_speculative_tokens": 4,
                                                 "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"})
    assert isinstance(changed.speculative_config, SpeculativeConfig)
    assert set(config.diff(changed)) == {"speculative_config"}
    with pytest.raises(ConfigError):
        config.replace(max_num_batched_tokens=8)


def test_load_yaml(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("model: meta-llama/Llama-3.1-70B-Instruct\ntensor_parallel_size: 4\nmax_num_seqs: 128\n")
    config = EngineConfig.load(str(path))
    assert config.tensor_parallel_size == 4 and config.resolved().max_num_batched_tokens == 8192
    path.write_text("max_num_seqs: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        EngineConfig.load(str(path))


@pytest.mark.parametrize("n", [0, 1, 2, 7, 100, 4096])
def test_synthetic_text_has_exactly_the_requested_tokens(n):
    assert count_tokens(synthetic_text(n)) == n
