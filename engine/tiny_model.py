"""A Llama-architecture model with random weights and a locally trained tokenizer, made in seconds, no download.

    python -m engine tiny-model DIR [--size test|study]

Real vLLM needs a model directory; the CPU build serves this one. The output text is
gibberish, but the timings, spans, metrics and scheduling are vLLM's own. Two sizes:

- ``test``: 2 layers, hidden 128 (~1.3 M parameters, ~3 MB): starts fast, for the test suite;
- ``study``: 4 layers, hidden 512 (~14 M parameters): a prompt's prefill costs real compute
  on a CPU (a few milliseconds per hundred tokens), for scheduling studies and calibration.

Deterministic: the weights come from a seeded NumPy generator, the tokenizer is a
byte-level BPE trained with Hugging Face ``tokenizers`` on a corpus generated from a
seed (not on files of this machine), and every file is written with sorted keys, so the
same command gives byte-identical files (``--check`` prints their SHA-256).

The directory holds what ``transformers`` and vLLM read: ``config.json``,
``generation_config.json``, ``model.safetensors`` (float16; vLLM serves it as bfloat16
with ``--dtype bfloat16``), ``tokenizer.json``, ``tokenizer_config.json`` (with a chat
template) and ``special_tokens_map.json``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, in this order
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
MAX_POSITIONS = 2048
# A plain chat template: one line per turn, then the assistant's turn when asked for.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ text }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyModelSize:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_parameters(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attention = h * self.num_attention_heads * d * 2 + h * self.num_kv_heads * d * 2
        per_layer = attention + 3 * h * i + 2 * h
        return 2 * v * h + self.num_layers * per_layer + h


SIZES = {
    "test": TinyModelSize("test", hidden_size=128, intermediate_size=256, num_layers=2, num_attention_heads=4,
                          num_kv_heads=2, vocab_size=4096),
    "study": TinyModelSize("study", hidden_size=512, intermediate_size=1536, num_layers=4, num_attention_heads=8,
                           num_kv_heads=4, vocab_size=4096),
}
SEED = 20261124


def build(directory: str | os.PathLike[str], size: str = "test", *, seed: int = SEED) -> Path:
    """Write the model and tokenizer into ``directory`` (created; existing files of the same names replaced)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, not {size!r}")
    spec = SIZES[size]
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    _write_json(target / "config.json", _config(spec))
    _write_json(target / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
    _write_weights(target / "model.safetensors", spec, seed)
    _write_tokenizer(target, spec, seed)
    return target


def checksums(directory: str | os.PathLike[str]) -> dict[str, str]:
    """SHA-256 of every file of a built model (what ``--check`` prints; equal across builds)."""
    out = {}
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            out[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _config(spec: TinyModelSize) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": MAX_POSITIONS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
        "llm_observatory_tiny_model": {"size": spec.name, "parameters": spec.num_parameters},
    }


def _tensors(spec: TinyModelSize, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    yield "model.embed_tokens.weight", normal(spec.vocab_size, h)
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        yield prefix + "self_attn.q_proj.weight", normal(spec.num_attention_heads * d, h)
        yield prefix + "self_attn.k_proj.weight", normal(spec.num_kv_heads * d, h)
        yield prefix + "self_attn.v_proj.weight", normal(spec.num_kv_heads * d, h)
        yield prefix + "self_attn.o_proj.weight", normal(h, spec.num_attention_heads * d)
        yield prefix + "mlp.gate_proj.weight", normal(i, h)
        yield prefix + "mlp.up_proj.weight", normal(i, h)
        yield prefix + "mlp.down_proj.weight", normal(h, i)
        yield prefix + "input_layernorm.weight", np.ones(h, dtype=np.float16)
        yield prefix + "post_attention_layernorm.weight", np.ones(h, dtype=np.float16)
    yield "model.norm.weight", np.ones(h, dtype=np.float16)
    yield "lm_head.weight", normal(spec.vocab_size, h)


def _write_weights(path: Path, spec: TinyModelSize, seed: int) -> None:
    from safetensors.numpy import save_file

    tensors = dict(_tensors(spec, seed))
    temporary = path.with_name(path.name + ".tmp")
    save_file(tensors, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, path)


def _corpus(seed: int, lines: int = 4000) -> Iterator[str]:
    """Pseudo-English from a seeded generator: words of common syllables, punctuation, digits and chat markers."""
    rng = np.random.default_rng(seed + 1)
    syllables = ("the an re in er on at en es or te of ed is it al ar st to nt ng se ha as ou io le ve co me "
                 "de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el ta la ns di fo ho pe ec pr no ct "
                 "us ac ot il tr ly nc et ut ss so rs un lo wa ge ie wh ee wi em ad ol rt po we na ul ni ts "
                 "mo ow pa im mi ai sh ir su id os iv ia am fi ci vi pl ig tu ev ld ry mp fe bl ab gh ty op "
                 "wo sa ay ex ke fr oo av ag if ap gr od bo sp rd do uc bu ei ov by rm ep tt oc fa ef cu rn").split()
    words = ["".join(rng.choice(syllables, size=int(rng.integers(1, 4)))) for _ in range(3000)]
    markers = ("<|system|>", "<|user|>", "<|assistant|>")
    for _ in range(lines):
        count = int(rng.integers(4, 24))
        sentence = " ".join(words[int(k)] for k in rng.zipf(1.3, size=count) % len(words))
        number = int(rng.integers(0, 100000))
        yield f"{markers[int(rng.integers(0, 3))]}\n{sentence.capitalize()}, {number}. {sentence.upper()}?\n"


def _write_tokenizer(target: Path, spec: TinyModelSize, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[UNK_ID]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    text = json.loads(tokenizer.to_str())
    _write_json(target / "tokenizer.json", text)
    _write_json(target / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(target / "special_tokens_map.json", {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
    })


def _write_json(path: Path, data: object) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(temporary, path)
