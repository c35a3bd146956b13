"""EngineConfig → ``vllm serve`` argv and OTel environment: golden argv, and vLLM's own parser when installed."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.launcher.cli import main
from engine.launcher.vllm_command import (
    VLLM_KNOBS,
    LaunchCommand,
    cpu_threads,
    encode_otlp_headers,
    render_simulator_command,
    render_vllm_command,
    write_config_file,
)
from engine.replica.cli import build_parser

CANARY = EngineConfig.from_dict({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
TUNED = EngineConfig.from_dict({
    "model": "Qwen/Qwen2.5-7B-Instruct", "tensor_parallel_size": 2, "gpu_type": "A100-80GB",
    "max_num_seqs": 128, "max_num_batched_tokens": 32768, "enable_chunked_prefill": False,
    "scheduling_policy": "priority", "gpu_memory_utilization": 0.85, "enable_prefix_caching": False,
    "block_size": 32, "max_model_len": 32768,
})
PARTIAL = EngineConfig.from_dict({"max_num_partial_prefills": 4, "max_long_partial_prefills": 2,
                                  "kv_cache_dtype": "fp8", "max_model_len": 65536})


def test_baseline_golden_argv():
    command = render_vllm_command(EngineConfig(), host="127.0.0.1", port=8101)
    assert command.argv == (
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--host", "127.0.0.1", "--port", "8101",
        "--tensor-parallel-size", "1", "--max-num-seqs", "1024", "--max-num-batched-tokens", "8192",
        "--long-prefill-token-threshold", "0", "--scheduling-policy", "fcfs", "--gpu-memory-utilization", "0.9",
        "--kv-cache-dtype", "auto", "--block-size", "16", "--max-model-len", "131072",
        "--enable-chunked-prefill", "--enable-prefix-caching", "--enable-prompt-tokens-details",
    )


def test_canary_renders_speculative_config_as_compact_json_with_resolved_lookup_window():
    argv = render_vllm_command(CANARY, host="127.0.0.1", port=8102).argv
    index = argv.index("--speculative-config")
    assert argv[index + 1] == '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":5,"prompt_lookup_min":5}'


def test_non_default_knobs_and_disabled_booleans():
    argv = render_vllm_command(TUNED, host="0.0.0.0", port=9000).argv
    assert argv[2] == "Qwen/Qwen2.5-7B-Instruct"
    pairs = dict(zip(argv[3::1], argv[4::1]))
    assert pairs["--tensor-parallel-size"] == "2" and pairs["--max-num-seqs"] == "128"
    assert pairs["--max-num-batched-tokens"] == "32768" and pairs["--scheduling-policy"] == "priority"
    assert pairs["--gpu-memory-utilization"] == "0.85" and pairs["--block-size"] == "32"
    assert "--no-enable-chunked-prefill" in argv and "--no-enable-prefix-caching" in argv
    assert "--enable-chunked-prefill" not in argv and "--enable-prefix-caching" not in argv
    partial = render_vllm_command(PARTIAL, host="127.0.0.1", port=8101).argv
    assert partial[partial.index("--long-prefill-token-threshold") + 1] == str(int(65536 * 0.04))
    assert partial[partial.index("--kv-cache-dtype") + 1] == "fp8"


def test_every_vllm_knob_of_the_config_is_rendered():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(VLLM_KNOBS) == fields - {"gpu_type"}  # gpu_type is the host's hardware, not a flag
    # kv_cache_memory_bytes is rendered only when set (on a GPU, vLLM plans the cache from gpu_memory_utilization).
    assert "--kv-cache-memory-bytes" not in render_vllm_command(CANARY, host="h", port=1).argv
    argv = " ".join(render_vllm_command(CANARY.replace(kv_cache_memory_bytes=2**30), host="h", port=1).argv)
    for knob in VLLM_KNOBS:
        if knob in ("model", "max_num_partial_prefills", "max_long_partial_prefills"):  # left out at 1 (vLLM 0.32)
            continue
        flag = "--" + knob.replace("_", "-")
        assert flag in argv, flag


def test_cpu_config_renders_vllm_cpu_build_command():
    """gpu_type CPU: vLLM's CPU build, eager, its environment, a bounded KV cache and the CPU defaults."""
    config = EngineConfig(model="/models/tiny", gpu_type="CPU")
    command = render_vllm_command(config, host="127.0.0.1", port=8101, served_model_name="tiny-llama",
                                  vllm_executable="/opt/vllm/bin/vllm", group="real")
    argv = list(command.argv)
    assert argv[:3] == ["/opt/vllm/bin/vllm", "serve", "/models/tiny"] and "--enforce-eager" in argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(256 * 1024**2)
    assert argv[argv.index("--max-num-seqs") + 1] == "128"  # vLLM's CPU default for the OpenAI server
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"
    assert command.env["VLLM_TARGET_DEVICE"] == "cpu" and command.env["HF_HUB_OFFLINE"] == "1"
    assert command.env["OTEL_BSP_SCHEDULE_DELAY"] == "200"
    resource = dict(item.split("=", 1) for item in command.env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
    assert resource["llm_observatory.model"] == "tiny-llama"
    assert resource["llm_observatory.replica_group"] == "real"
    # The model's threads: every core but one unless told (one core left to the API server and the host).
    assert command.env["OMP_NUM_THREADS"] == str(cpu_threads()) == str(max(1, len(os.sched_getaffinity(0)) - 1))
    four = render_vllm_command(config, host="127.0.0.1", port=8101, threads=4)
    assert four.env["OMP_NUM_THREADS"] == "4"
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            render_vllm_command(config, host="127.0.0.1", port=8101, threads=bad)
    # A GPU config gets neither the CPU environment nor --enforce-eager.
    gpu = render_vllm_command(EngineConfig(), host="127.0.0.1", port=8101)
    assert "VLLM_TARGET_DEVICE" not in gpu.env and "--enforce-eager" not in gpu.argv
    assert "OMP_NUM_THREADS" not in gpu.env
    assert "llm_observatory.model=meta-llama%2FLlama-3.1-8B-Instruct" in gpu.env["OTEL_RESOURCE_ATTRIBUTES"]


def test_cpu_threads_leave_one_core():
    assert [cpu_threads(n) for n in (1, 2, 4, 64)] == [1, 1, 3, 63]


def test_tracing_flags_and_environment():
    command = render_vllm_command(
        CANARY, host="127.0.0.1", port=8102, served_model_name="llama-8b",
        otlp_traces_endpoint="http://127.0.0.1:4317", otlp_protocol="grpc",
        otlp_headers={"authorization": "Bearer ik_abc/123=="}, resource_attributes={"deployment.environment": "dev"},
        collect_detailed_traces="all", group="canary",
    )
    argv = command.argv
    assert argv[argv.index("--served-model-name") + 1] == "llama-8b"
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4317"
    assert argv[argv.index("--collect-detailed-traces") + 1] == "all"
    env = command.env
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    assert env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "authorization=Bearer%20ik_abc%2F123%3D%3D"
    assert env["OTEL_SERVICE_NAME"] == "vllm"
    attributes = dict(item.split("=", 1) for item in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
    assert attributes == {"deployment.environment": "dev", "llm_observatory.engine_config": CANARY.version,
                          "llm_observatory.replica_group": "canary", "llm_observatory.model": "llama-8b"}
    http = render_vllm_command(CANARY, host="127.0.0.1", port=8102, otlp_protocol="http/protobuf")
    assert http.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert "--otlp-traces-endpoint" not in http.argv and "OTEL_EXPORTER_OTLP_TRACES_HEADERS" not in http.env


def test_the_otel_header_encoding_round_trips_through_the_sdk_parser():
    from engine.telemetry import _parse_headers

    headers = {"authorization": "Bearer a b,c=d%", "x-tenant": "ü"}
    assert _parse_headers(encode_otlp_headers(headers)) == headers


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"port": 0}, "port must be"),
    ({"port": "8101"}, "port must be"),
    ({"host": "a b"}, "host must be"),
    ({"collect_detailed_traces": "everything"}, "collect_detailed_traces"),
    ({"otlp_protocol": "http/json"}, "otlp_protocol"),
    ({"otlp_headers": {"bad=name": "x"}}, "header name"),
])
def test_bad_arguments_are_refused_with_a_reason(kwargs, needle):
    arguments = {"host": "127.0.0.1", "port": 8101, **kwargs}
    with pytest.raises(ValueError, match=needle):
        render_vllm_command(EngineConfig(), **arguments)


def test_simulator_command_has_the_same_contract(tmp_path):
    path = write_config_file(CANARY, tmp_path / "configs" / "canary.json")
    assert EngineConfig.from_dict(json.loads(path.read_text())).version == CANARY.version
    command = render_simulator_command(
        CANARY, config_path=path, host="127.0.0.1", port=8102, group="canary", served_model_name="llama",
        otlp_traces_endpoint="127.0.0.1:4317", otlp_headers={"authorization": "Bearer k"}, seed=7,
    )
    assert command.argv == (
        sys.executable, "-m", "engine.replica", "--config", str(path), "--host", "127.0.0.1", "--port", "8102",
        "--group", "canary", "--enable-prompt-tokens-details", "--served-model-name", "llama", "--otlp-traces-endpoint", "127.0.0.1:4317",
        "--seed", "7",
    )
    assert command.env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "authorization=Bearer%20k"
    # The simulator's own parser reads it back (prompt-token details on, as for vLLM).
    parsed = build_parser().parse_args(list(command.argv[3:]))
    assert parsed.enable_prompt_tokens_details is True and parsed.group == "canary" and parsed.seed == 7
    assert f"llm_observatory.engine_config={CANARY.version}" in command.env["OTEL_RESOURCE_ATTRIBUTES"]
    with pytest.raises(ValueError, match="group"):
        render_simulator_command(CANARY, config_path=path, host="127.0.0.1", port=8102, group="")


def test_shell_line_is_copy_pasteable():
    command = LaunchCommand(argv=("vllm", "serve", "m", "--speculative-config", '{"a":1}'), env={"K": "a b"})
    assert command.shell() == "K='a b' vllm serve m --speculative-config '{\"a\":1}'"
    # For log files: the values of credential-carrying variables are redacted, the rest kept.
    secret = LaunchCommand(argv=("vllm", "serve", "m"), env={
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "authorization=Bearer%20lok_secret", "HF_TOKEN": "hf_x",
        "OTEL_SERVICE_NAME": "vllm"})
    line = secret.shell(redact=True)
    assert "lok_secret" not in line and "hf_x" not in line and "OTEL_SERVICE_NAME=vllm" in line
    assert "OTEL_EXPORTER_OTLP_TRACES_HEADERS='<redacted>'" in line


def test_render_cli(tmp_path, capsys):
    config_file = tmp_path / "canary.yaml"
    config_file.write_text("speculative_config: {method: ngram, num_speculative_tokens: 3}\n")
    assert main(["render", "--config", str(config_file), "--port", "8200", "--group", "canary"]) == 0
    line = capsys.readouterr().out.strip()
    assert "vllm serve meta-llama/Llama-3.1-8B-Instruct --host 127.0.0.1 --port 8200" in line
    assert f"llm_observatory.engine_config={CANARY.version}" in line
    assert main(["render", "--config", str(config_file), "--backend", "simulator", "--json"]) == 0
    rendered = json.loads(capsys.readouterr().out)
    assert rendered["argv"][1:3] == ["-m", "engine.replica"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqs: 0\nblock_sise: 16\n")
    assert main(["render", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "max_num_seqs must be an integer >= 1" in err and "unknown engine config key 'block_sise'" in err
    assert main(["render", "--config", str(tmp_path / "missing.yaml")]) == 2


CPU_TINY = EngineConfig.from_dict({"model": "/models/tiny", "gpu_type": "CPU", "max_num_seqs": 8,
                                   "kv_cache_memory_bytes": 64 * 1024**2, "enable_chunked_prefill": False,
                                   "max_num_batched_tokens": 4096, "max_model_len": 2048})

# Run inside vLLM's own virtualenv (make vllm): parse each named argv with `vllm serve`'s parser; print, by name,
# the namespace or the parser's complaint. One process for all: importing vLLM takes ~30 s on a loaded 2-core host.
_PARSE_WITH_VLLM = """
import contextlib, io, json, sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # vLLM 0.32
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for name, argv in json.load(sys.stdin).items():
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            out[name] = vars(make_arg_parser(FlexibleArgumentParser()).parse_args(argv))
    except SystemExit:
        out[name] = {"error": complaint.getvalue()}
print(json.dumps(out, default=str))
"""
VLLM_PARSER_CASES = {"baseline": EngineConfig(), "canary": CANARY, "tuned": TUNED, "cpu": CPU_TINY}


def _contract_command(config: EngineConfig) -> LaunchCommand:
    return render_vllm_command(config, host="127.0.0.1", port=8101, served_model_name="served",
                               otlp_traces_endpoint="http://127.0.0.1:4317", collect_detailed_traces="all")


@pytest.fixture(scope="module")
def parsed_by_vllm(real_vllm_python) -> dict[str, dict]:
    argvs = {name: list(_contract_command(config).argv[2:]) for name, config in VLLM_PARSER_CASES.items()}
    parsed = subprocess.run([real_vllm_python, "-c", _PARSE_WITH_VLLM], input=json.dumps(argvs),
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    return json.loads(parsed.stdout.strip().splitlines()[-1])


# tests/engine runs in the server suite, where OBSERVATORY_REAL_VLLM=0 skips real vLLM: this one runs in the
# embedded suite, beside the other real-vLLM tests (tests/engine/test_real_vllm.py).
@pytest.mark.mode_independent(suite="embedded")
@pytest.mark.parametrize("name", list(VLLM_PARSER_CASES))
def test_vllm_own_parser_accepts_the_argv(name, parsed_by_vllm):
    """Contract test: real vLLM's ``vllm serve`` parser (make vllm) reads back every knob we render.

    It found that vLLM 0.32 no longer has --max-num-partial-prefills / --max-long-partial-prefills: they
    are left out at their default (PARTIAL's values above 1 are V0-only and not checked here).
    """
    config = VLLM_PARSER_CASES[name]
    assert _contract_command(config).argv[:2] == ("vllm", "serve")
    args = parsed_by_vllm[name]
    assert "error" not in args, args.get("error")
    resolved = config.resolved()
    assert args["model_tag"] == config.model and args["host"] == "127.0.0.1" and args["port"] == 8101
    assert args["served_model_name"] in ("served", ["served"])
    for knob in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                 "scheduling_policy", "gpu_memory_utilization", "kv_cache_dtype", "block_size", "max_model_len",
                 "enable_chunked_prefill", "enable_prefix_caching", "kv_cache_memory_bytes"):
        assert args[knob] == getattr(resolved, knob), knob
    expected_spec = resolved.speculative_config.to_dict() if resolved.speculative_config else None
    assert (json.loads(args["speculative_config"].replace("'", '"')) if isinstance(args["speculative_config"], str)
            else args["speculative_config"]) == expected_spec
    assert args["otlp_traces_endpoint"] == "http://127.0.0.1:4317"
    assert args["collect_detailed_traces"] in ("all", ["all"], "['all']")
    assert args["enforce_eager"] is (config.gpu_type == "CPU")
    # Usage says how many prompt tokens the prefix cache served (prompt_tokens_details.cached_tokens).
    assert args["enable_prompt_tokens_details"] is True
