"""`python -m engine tiny-model`: deterministic, loadable files; the CPU config's defaults; local model profiles."""
from __future__ import annotations

import json

import pytest

from engine import tiny_model
from engine.config import ConfigError, EngineConfig
from engine.launcher.cli import main
from engine.launcher.fleet_spec import FleetSpec
from engine.sim.profiles import model_profile


def test_build_is_deterministic_and_complete(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "a"), "--check"]) == 0
    first = capsys.readouterr().out
    assert main(["tiny-model", str(tmp_path / "b"), "--check"]) == 0
    second = capsys.readouterr().out
    sums = [line for line in first.splitlines() if "  " in line]
    assert sums and sums == [line for line in second.splitlines() if "  " in line]
    names = {line.split("  ")[1] for line in sums}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer_config.json"}
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    # The weights have the shapes a Llama of that config needs, and the parameter count the CLI printed.
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    assert sum(t.size for t in tensors.values()) == tiny_model.SIZES["test"].num_parameters
    # The tokenizer round-trips text, and the chat template is there.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    ids = tokenizer.encode("How long is a piece of string? 42 ünïcode").ids
    assert max(ids) < config["vocab_size"]
    assert tokenizer.decode(ids) == "How long is a piece of string? 42 ünïcode"
    assert "add_generation_prompt" in json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())[
        "chat_template"]


def test_study_size_and_its_profile(tmp_path):
    directory = tiny_model.build(tmp_path / "study", "study")
    profile = model_profile(str(directory))
    assert (profile.num_layers, profile.hidden_size, profile.num_kv_heads, profile.head_dim) == (4, 512, 4, 64)
    assert profile.total_params == tiny_model.SIZES["study"].num_parameters
    # The context length comes from the directory's config.json, as vLLM derives it.
    assert EngineConfig(model=str(directory), gpu_type="CPU").resolved().max_model_len == 2048
    with pytest.raises(ValueError, match="size must be one of"):
        tiny_model.build(tmp_path / "x", "huge")


def test_cpu_config_defaults_and_rules(tmp_path):
    resolved = EngineConfig(model="m", gpu_type="CPU").resolved()
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.block_size) == (128, 2048, 128)
    assert resolved.kv_cache_memory_bytes == 256 * 1024**2
    assert EngineConfig().resolved().block_size == 16 and EngineConfig().resolved().kv_cache_memory_bytes is None
    with pytest.raises(ConfigError, match="multiple of 32 on CPU"):
        EngineConfig(gpu_type="CPU", block_size=16).validate()
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be an integer >= 1"):
        EngineConfig(kv_cache_memory_bytes=0).validate()


def test_fleet_refuses_a_gpu_type_without_a_gpu_and_a_missing_vllm(tmp_path):
    spec = FleetSpec.from_dict({
        "run_dir": str(tmp_path), "vllm": {"executable": str(tmp_path / "nowhere" / "vllm")},
        "groups": [{"name": "gpu", "backend": "vllm", "config": {"gpu_type": "H100"}},
                   {"name": "cpu", "backend": "vllm", "config": {"gpu_type": "CPU", "model": "m"}}]})
    problems = spec.host_problems(has_gpu=False)
    assert any("group 'gpu': gpu_type H100 needs a GPU" in p for p in problems)
    assert not any("group 'cpu'" in p for p in problems)
    assert any("nowhere/vllm is not one" in p for p in problems)
    assert [p for p in spec.host_problems(has_gpu=True) if "group" in p] == []
    with pytest.raises(Exception, match="unknown key vllm.path"):
        FleetSpec.from_dict({"run_dir": str(tmp_path), "vllm": {"path": "x"},
                             "groups": [{"name": "g", "backend": "simulator"}]})
