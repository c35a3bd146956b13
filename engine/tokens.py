"""A deterministic stand-in tokenizer shared by the simulator replicas and the load generator.

Model weights and their tokenizers cannot be downloaded here, so the simulator counts
tokens with this rule: every run of word characters and every other non-space
character is one token. ``synthetic_text(n)`` builds text of exactly ``n`` tokens,
which lets the load generator ask for a prompt length and the replica count the same.
"""
from __future__ import annotations

import random
import re
import zlib

_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)

# Common English words, so synthetic prompts look like text in logs and UIs.
_WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well such here take why "
    "things help put years different away again off went old number great tell men say small every found still "
    "between name should home big give air line set own under read last never us left end along while might next "
    "sound below saw something thought both few those always looked show large often together asked house world"
).split()


def count_tokens(text: str) -> int:
    """Number of tokens in ``text`` under the stand-in rule."""
    return sum(1 for _ in _TOKEN.finditer(text))


def token_ends(text: str) -> list[int]:
    """The end offset of each token of ``text`` (text[:ends[k-1]] holds its first k tokens)."""
    return [match.end() for match in _TOKEN.finditer(text)]


def token_ids(text: str, vocab_size: int = 128_256) -> list[int]:
    """Stable ids for the tokens of ``text`` (for prefix-cache block hashing); same text → same ids."""
    return [zlib.crc32(match.group().encode("utf-8")) % vocab_size for match in _TOKEN.finditer(text)]


def synthetic_text(num_tokens: int, rng: random.Random | None = None) -> str:
    """Text of exactly ``num_tokens`` tokens (words, with a full stop every dozen or so)."""
    if num_tokens < 0:
        raise ValueError("num_tokens must be >= 0")
    rng = rng or random.Random(0)
    parts: list[str] = []
    produced = 0
    while produced < num_tokens:
        if produced and num_tokens - produced >= 1 and rng.random() < 0.08:
            parts[-1] += "."
        else:
            parts.append(rng.choice(_WORDS))
        produced += 1
    return " ".join(parts)
