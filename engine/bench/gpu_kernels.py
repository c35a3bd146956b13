"""Time a model's forward passes on this machine's GPU and set them beside the simulator's roofline for that GPU.

    python -m engine.bench.gpu_kernels [--gpu-type H200] [--model meta-llama/Llama-3.1-8B-Instruct] [--json FILE]
    python -m engine.bench.gpu_kernels --from-json FILE      (the comparison again, from saved timings; no GPU)

Needs PyTorch with CUDA; not vLLM. It builds the model profile's decoder (engine/sim/profiles.py: every layer's
QKV, output, gate-up and down projections, RMSNorms, rotary embedding, attention and the LM head) with random bf16
weights, and times on the GPU:

- prefill passes of one sequence (causal attention over its own tokens, one logit);
- decode steps of a batch at a context length (one new token per sequence attending to its KV cache, one logit
  each);

each replayed from a CUDA graph, as vLLM runs its passes, after measuring what the GPU reaches at all (a 2 GiB
copy and an 8192-square bf16 matrix product). Beside each pass it prints the simulator's time for it on the named
hardware profile (StepCostModel.pass_time) with the per-layer gaps but without the per-step and per-sequence costs,
which stand for vLLM's scheduling, input preparation and sampling that a bare forward pass does not have. Then:

    BENCH gpu_kernels_prefill_mfu=…                 (FLOP/s of the longest prefill over the datasheet peak)
    BENCH gpu_kernels_decode_bandwidth_efficiency=…  (bytes/s of the batch-1 decode step over the datasheet bandwidth)
    BENCH gpu_kernels_matmul_flops_share=…           (the large matrix product's FLOP/s over the datasheet peak)
    BENCH gpu_kernels_copy_bandwidth_share=…         (the large copy's bytes/s, read and written, over the datasheet)
    BENCH gpu_kernels_roofline_error_max_pct=… %    (worst |profile / measured - 1| over every pass)
    BENCH gpu_kernels_fitted_<constant>=…           (MFU, bandwidth efficiency and serial fraction fitted to the
                                                     passes by least squares on log time)

These are the kernels' times only, a lower bound on a vLLM step's: a profile's fitted constants come from vLLM's
own figures (engine/sim/calibration.py) or from a group's traffic (engine/sim/traffic_fit.py).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence

from engine.sim.cost_model import StepCostModel
from engine.sim.profiles import HardwareProfile, ModelProfile, hardware_profile, model_profile

# Both optional: the comparison runs anywhere, without PyTorch (--from-json); vLLM's virtualenv, where the passes run
# on a CPU to check this program, has PyTorch and no SciPy (no fit then).
try:
    import torch
    import torch.nn.functional as functional
except ImportError:
    torch = functional = None
try:
    from scipy.optimize import least_squares
except ImportError:
    least_squares = None

PREFILL_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
# (batch, context) of the decode steps: batch 1 reads the weights alone; the large batches read as much KV.
DECODE_SHAPES = ((1, 512), (1, 4096), (8, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 512), (256, 1024),
                 (64, 4096))
REPEATS = 20


# ---------------------------------------------------------------------------------------------- the comparison
def pass_shape(kind: str, tokens: int, batch: int, context: int) -> tuple[int, int, float, float]:
    """(num_tokens, num_logits, attention pairs, KV tokens read) as engine/sim/core.py counts them."""
    if kind == "prefill":
        return tokens, 1, tokens * (tokens + 1) / 2.0, float(tokens)
    return batch, batch, float(batch * (context + 1)), float(batch * (context + 1))


def roofline(model: ModelProfile, hardware: HardwareProfile) -> StepCostModel:
    """The profile's cost of a forward pass alone: its roofline and per-layer gaps, without the per-step and
    per-sequence costs that stand for vLLM's scheduling, input preparation and sampling."""
    bare = hardware.with_constants(step_overhead=0.0, sequence_overhead=0.0)
    return StepCostModel(model, bare)


def compare(result: dict) -> list[str]:
    """BENCH lines and a table: each measured pass beside the profile's roofline."""
    model = model_profile(result["model"])
    hardware = hardware_profile(result["gpu_type"])
    cost = roofline(model, hardware)
    lines = [f"# {result['device']} (PyTorch {result['torch']}), {result['model']}, profile {hardware.name}: "
             f"mfu {hardware.mfu}, bandwidth_efficiency {hardware.bandwidth_efficiency}, "
             f"serial_fraction {hardware.serial_fraction}",
             f"# {'pass':<22} {'measured ms':>12} {'profile ms':>11} {'error':>8} {'TFLOP/s':>8} {'TB/s':>6}"]
    worst = 0.0
    rows = []
    for entry in result["passes"]:
        shape = pass_shape(entry["kind"], entry.get("tokens", 0), entry.get("batch", 0), entry.get("context", 0))
        predicted = cost.pass_time(*shape)
        measured = entry["ms"] / 1e3
        error = predicted / measured - 1.0
        worst = max(worst, abs(error))
        flops, nbytes = cost.pass_flops(*shape[:3]), cost.pass_bytes(shape[0], shape[3])
        rows.append((entry, shape, measured, flops, nbytes))
        label = (f"prefill {entry['tokens']}" if entry["kind"] == "prefill"
                 else f"decode {entry['batch']}x{entry['context']}")
        lines.append(f"# {label:<22} {measured * 1e3:>12.3f} {predicted * 1e3:>11.3f} {error * 100:>+7.1f}% "
                     f"{flops / measured / 1e12:>8.1f} {nbytes / measured / 1e12:>6.2f}")
    longest = max((r for r in rows if r[0]["kind"] == "prefill"), key=lambda r: r[0]["tokens"])
    lone = min((r for r in rows if r[0]["kind"] == "decode"), key=lambda r: (r[0]["batch"], r[0]["context"]))
    peak = hardware.fp8_flops if model.weight_dtype_bytes == 1 and hardware.fp8_flops else hardware.bf16_flops
    lines.append(f"BENCH gpu_kernels_prefill_mfu={longest[3] / longest[2] / peak:.3f}")
    lines.append(f"BENCH gpu_kernels_decode_bandwidth_efficiency={lone[4] / lone[2] / hardware.hbm_bandwidth:.3f}")
    ceilings = result.get("ceilings") or {}
    if "matmul_flops_per_s" in ceilings:
        lines.append(f"BENCH gpu_kernels_matmul_flops_share={ceilings['matmul_flops_per_s'] / peak:.3f}")
    if "copy_bytes_per_s" in ceilings:
        lines.append(f"BENCH gpu_kernels_copy_bandwidth_share={ceilings['copy_bytes_per_s'] / hardware.hbm_bandwidth:.3f}")
    lines.append(f"BENCH gpu_kernels_roofline_error_max_pct={worst * 100:.1f} %")
    fitted = fit_constants(model, hardware, [(r[1], r[2]) for r in rows])
    if fitted is not None:
        for name, value in fitted.items():
            lines.append(f"BENCH gpu_kernels_fitted_{name}={value:.3f}")
    return lines


def fit_constants(model: ModelProfile, hardware: HardwareProfile,
                  observed: Sequence[tuple[tuple[int, int, float, float], float]]) -> dict[str, float] | None:
    """MFU, bandwidth efficiency and serial fraction that best explain the measured passes (SciPy; None without)."""
    if least_squares is None:
        return None

    def residuals(x):
        profile = hardware.with_constants(mfu=x[0], bandwidth_efficiency=x[1], serial_fraction=x[2])
        cost = roofline(model, profile)
        return [math.log(cost.pass_time(*shape) / measured) for shape, measured in observed]

    start = [hardware.mfu, hardware.bandwidth_efficiency, hardware.serial_fraction]
    answer = least_squares(residuals, start, bounds=([0.05, 0.05, 0.0], [1.0, 1.0, 1.0]))
    return {"mfu": float(answer.x[0]), "bandwidth_efficiency": float(answer.x[1]),
            "serial_fraction": float(answer.x[2])}


# ---------------------------------------------------------------------------------------------- the GPU side
def measure(model_name: str, gpu_type: str, *, prefill: Sequence[int], decode: Sequence[tuple[int, int]],
            repeats: int, device: str = "cuda") -> dict:
    """Time the passes; the weights are random, so only the times mean anything."""
    if torch is None:
        raise SystemExit("this bench times the passes with PyTorch, which is not installed here")
    model = model_profile(model_name)
    if model.is_moe:
        raise SystemExit(f"{model_name} is a mixture of experts; this bench builds dense decoders only")
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("PyTorch sees no CUDA device")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    hidden, heads, kv_heads, head_dim = model.hidden_size, model.num_attention_heads, model.num_kv_heads, model.head_dim
    group = heads // kv_heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim

    def weight(*shape: int):
        return torch.empty(*shape, device=device, dtype=dtype).normal_(0.0, 0.02)

    layers = [{"ln1": torch.ones(hidden, device=device, dtype=dtype), "qkv": weight(hidden, q_out + 2 * kv_out),
               "o": weight(q_out, hidden), "ln2": torch.ones(hidden, device=device, dtype=dtype),
               "gate_up": weight(hidden, 2 * model.intermediate_size), "down": weight(model.intermediate_size, hidden)}
              for _ in range(model.num_layers)]
    embedding = weight(model.vocab_size, hidden)
    lm_head = embedding.t() if model.tie_word_embeddings else weight(hidden, model.vocab_size)
    final_norm = torch.ones(hidden, device=device, dtype=dtype)
    longest = max([*prefill, *(context + 1 for _, context in decode)])
    inverse = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(longest, device=device, dtype=torch.float32), inverse)
    cos_table, sin_table = angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate(x, cos, sin):  # x (..., T, H, D); cos/sin (T, D/2)
        first, second = x[..., : head_dim // 2], x[..., head_dim // 2:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    def mlp_and_residual(x, layer):
        h = functional.rms_norm(x, (hidden,), layer["ln2"])
        gate, up = (h @ layer["gate_up"]).chunk(2, dim=-1)
        return x + (functional.silu(gate) * up) @ layer["down"]

    native_gqa = [True]

    def causal_attention(q, k, v):
        """Grouped-query attention in one kernel where this PyTorch's SDPA takes it; else K and V repeated per query
        head (a few per cent more memory traffic on a compute-bound pass)."""
        if native_gqa[0]:
            try:
                return functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except (RuntimeError, TypeError):
                native_gqa[0] = False
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def prefill_pass(tokens):  # one sequence of len(tokens), causal
        count = tokens.shape[0]
        x = embedding[tokens]
        cos, sin = cos_table[:count], sin_table[:count]
        for layer in layers:
            h = functional.rms_norm(x, (hidden,), layer["ln1"])
            q, k, v = (h @ layer["qkv"]).split((q_out, kv_out, kv_out), dim=-1)
            q = rotate(q.view(count, heads, head_dim), cos, sin).transpose(0, 1)[None]
            k = rotate(k.view(count, kv_heads, head_dim), cos, sin).transpose(0, 1)[None]
            v = v.view(count, kv_heads, head_dim).transpose(0, 1)[None]
            a = causal_attention(q, k, v)
            x = x + a[0].transpose(0, 1).reshape(count, q_out) @ layer["o"]
            x = mlp_and_residual(x, layer)
        last = functional.rms_norm(x[-1:], (hidden,), final_norm)
        return last @ lm_head

    def decode_step(tokens, caches, context):  # one new token per sequence at position `context`
        batch = tokens.shape[0]
        x = embedding[tokens]
        cos, sin = cos_table[context:context + 1], sin_table[context:context + 1]
        for layer, (k_cache, v_cache) in zip(layers, caches):
            h = functional.rms_norm(x, (hidden,), layer["ln1"])
            q, k, v = (h @ layer["qkv"]).split((q_out, kv_out, kv_out), dim=-1)
            q = rotate(q.view(batch, 1, heads, head_dim), cos, sin).view(batch, heads, head_dim)
            k = rotate(k.view(batch, 1, kv_heads, head_dim), cos, sin).view(batch, kv_heads, head_dim)
            k_cache[:, :, context] = k
            v_cache[:, :, context] = v.view(batch, kv_heads, head_dim)
            # Grouped-query decode: each KV head's query heads are that head's queries, over the context and itself.
            grouped = q.view(batch, kv_heads, group, head_dim)
            a = functional.scaled_dot_product_attention(grouped, k_cache[:, :, :context + 1],
                                                        v_cache[:, :, :context + 1])
            x = x + a.reshape(batch, q_out) @ layer["o"]
            x = mlp_and_residual(x, layer)
        return functional.rms_norm(x, (hidden,), final_norm) @ lm_head

    def timed(run, count: int) -> float:
        """Median milliseconds of ``count`` runs after three warm-ups."""
        for _ in range(3):
            run()
        samples = []
        for _ in range(count):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                run()
                samples.append((time.perf_counter() - began) * 1e3)
        return statistics.median(samples)

    def replayed(step) -> float:
        """Median milliseconds of ``step`` replayed from a CUDA graph (as vLLM runs its passes), or run eagerly on a
        CPU."""
        if not cuda:
            return timed(step, repeats)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        try:
            return timed(graph.replay, repeats)
        finally:
            del graph
            torch.cuda.empty_cache()

    passes = []
    ceilings = {}
    with torch.inference_mode():
        if cuda:  # what this GPU reaches at all: a large copy and a large bf16 matrix product
            source = torch.empty(2 * 1024**3, device=device, dtype=torch.uint8)
            target = torch.empty_like(source)
            ms = timed(lambda: target.copy_(source), 10)
            ceilings["copy_bytes_per_s"] = 2 * source.numel() / (ms / 1e3)
            del source, target
            a = torch.randn(8192, 8192, device=device, dtype=dtype)
            b = torch.randn(8192, 8192, device=device, dtype=dtype)
            ms = timed(lambda: a @ b, 10)
            ceilings["matmul_flops_per_s"] = 2 * 8192**3 / (ms / 1e3)
            del a, b
            print(f"# ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
                  f"bf16 matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
        for count in prefill:
            tokens = torch.randint(0, model.vocab_size, (count,), device=device)
            ms = replayed(lambda tokens=tokens: prefill_pass(tokens))
            passes.append({"kind": "prefill", "tokens": count, "ms": ms})
            print(f"# prefill {count}: {ms:.3f} ms", flush=True)
        for batch, context in decode:
            caches = [(torch.empty(batch, kv_heads, context + 1, head_dim, device=device, dtype=dtype).normal_(),
                       torch.empty(batch, kv_heads, context + 1, head_dim, device=device, dtype=dtype).normal_())
                      for _ in range(model.num_layers)]
            tokens = torch.randint(0, model.vocab_size, (batch,), device=device)
            ms = replayed(lambda tokens=tokens, caches=caches, context=context: decode_step(tokens, caches, context))
            passes.append({"kind": "decode", "batch": batch, "context": context, "ms": ms})
            print(f"# decode {batch}x{context}: {ms:.3f} ms", flush=True)
            del caches
    name = torch.cuda.get_device_name() if cuda else "CPU"
    return {"model": model_name, "gpu_type": gpu_type, "device": name, "torch": torch.__version__,
            "repeats": repeats, "prefill_attention": "grouped" if native_gqa[0] else "repeated", "ceilings": ceilings,
            "passes": passes}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.gpu_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-type", default="H200", help="the simulator's hardware profile to compare with")
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct",
                        help="a model profile (engine/sim/profiles.py) or a local model directory")
    parser.add_argument("--json", metavar="FILE", help="also write the timings to FILE")
    parser.add_argument("--from-json", metavar="FILE", help="compare saved timings instead of measuring")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per pass (the median is kept)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu runs the same passes eagerly, to check this program without a GPU")
    parser.add_argument("--quick", action="store_true", help="two prefill lengths and two decode shapes")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as handle:
            result = json.load(handle)
    else:
        hardware_profile(args.gpu_type)  # an unknown name fails before the GPU work
        prefill = PREFILL_TOKENS[:2] if args.quick else PREFILL_TOKENS
        decode = DECODE_SHAPES[:2] if args.quick else DECODE_SHAPES
        began = time.monotonic()
        result = measure(args.model, args.gpu_type, prefill=prefill, decode=decode, repeats=args.repeats,
                         device=args.device)
        result["seconds"] = round(time.monotonic() - began, 1)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(result, handle, indent=2)
    for line in compare(result):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
