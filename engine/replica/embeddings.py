"""A stand-in embedding model for the simulated replica's ``POST /v1/embeddings``.

It is NOT a language model's embedding: a text's vector is a hashed bag of its lower-cased
words and of the character trigrams of each word (``^wo``, ``wor``, ``ord``, ``rd$``),
each feature hashed (CRC-32) to one of ``dimension`` coordinates with a sign, words
weighing twice a trigram, L2-normalised. So the same text always gets the same vector,
texts sharing most words and spellings come out close (a reworded question with the same
key words: cosine about 0.8-0.95), unrelated texts near 0; a text without a word is the zero
vector. It gives the gateway's semantic
cache, fleets and tests an embeddings endpoint without model weights; real deployments
point the cache at a real embedding model (vLLM serves those with ``--runner pooling``,
``--task embed`` in older releases).

The request and response follow OpenAI's embeddings API as vLLM serves it: ``input`` a
string or a list of strings, ``encoding_format`` ``float`` or ``base64`` (little-endian
float32), ``dimensions`` only equal to the model's (it is not a Matryoshka model).
"""
from __future__ import annotations

import base64
import re
import time
import uuid
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.replica.openai_api import ApiError
from engine.tokens import count_tokens

DEFAULT_DIMENSION = 384
MAX_DIMENSION = 8192
MAX_INPUTS = 2048
_WORD = re.compile(r"\w+", re.UNICODE)
_WORD_WEIGHT = 2.0
_TRIGRAM_WEIGHT = 1.0


def embed_text(text: str, dimension: int = DEFAULT_DIMENSION) -> np.ndarray:
    """The stand-in embedding of ``text``: an L2-normalised float32 vector (zero for text without words)."""
    vector = np.zeros(dimension, dtype=np.float64)
    for word in _WORD.findall(text.lower()):
        features = [(word, _WORD_WEIGHT)]
        padded = f"^{word}$"
        features.extend((padded[i:i + 3], _TRIGRAM_WEIGHT) for i in range(len(padded) - 2))
        for feature, weight in features:
            code = zlib.crc32(feature.encode("utf-8"))
            vector[code % dimension] += weight if code & 0x80000000 else -weight
    norm = float(np.linalg.norm(vector))
    return (vector / norm if norm else vector).astype(np.float32)


def _inputs(body: Mapping[str, Any]) -> list[str]:
    value = body.get("input")
    if value == "" or (isinstance(value, list) and "" in value):
        raise ApiError("'input' must not hold empty strings", param="input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        if len(value) > MAX_INPUTS:
            raise ApiError(f"'input' may hold at most {MAX_INPUTS} texts", param="input")
        return value
    if isinstance(value, list) and value and all(isinstance(item, (int, list)) for item in value):
        raise ApiError("'input' as token ids is not supported by the simulated replica; send text", param="input")
    raise ApiError("'input' must be a non-empty string or a non-empty list of strings", param="input")


def embeddings_response(body: object, *, served_model_name: str, dimension: int) -> dict[str, Any]:
    """The answer to an embeddings request (``body`` as decoded JSON), or ApiError as vLLM would refuse it."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model_name:
        raise ApiError(f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model")
    texts = _inputs(body)
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or dimensions != dimension):
        raise ApiError(f"Model \"{served_model_name}\" does not support matryoshka representation, changing output "
                       f"dimensions will lead to poor results (it has {dimension})", param="dimensions")
    data = []
    for index, text in enumerate(texts):
        vector = embed_text(text, dimension)
        embedding: object = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                             if encoding == "base64" else vector.tolist())
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    tokens = sum(count_tokens(text) for text in texts)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": served_model_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}
