"""Golden datasets: parsing items (three file formats and the API's JSON), checking them, and writing versions.

Item (the API's and the JSONL "openai" format's shape):

    {"id": "capital-fr",                                  # upsert key; default: "item-<line>"
     "messages": [{"role": "user", "content": "..."}],     # or "prompt": "..."
     "params": {"max_tokens": 64, "temperature": 0},      # sent with the request
     "expected": "Paris",                                 # optional
     "evaluators": [{"type": "contains", "value": "Paris"}],
     "tags": ["geo"], "metadata": {...}}

Formats of `manage.py dataset import`:

- `openai`: JSONL, one chat per line (`messages`, as OpenAI's chat fine-tuning and evals files). A final
  assistant message is the expected output when `expected` (or evals' `ideal`) is absent. `max_tokens`,
  `temperature`, ... may sit at the top level instead of in `params`.
- `vllm`: JSONL as `vllm bench serve --dataset-name custom` reads it: `{"prompt": ...}` and optionally
  `output_tokens` (→ max_tokens) and `completion`/`expected`.
- `sharegpt`: the ShareGPT JSON array (`{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}`),
  read as vLLM's benchmark reads it: the first human turn (after an optional system turn) is the prompt, the
  reply after it the expected output, whose token count is max_tokens.

A file with any bad line imports nothing: every problem is reported with its line (or entry) number.
"""
from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterable
from typing import Any

from django.db import OperationalError, transaction

from engine.tokens import count_tokens, synthetic_text

from . import queries
from .evaluators import EvaluatorError, check_evaluators
from .models import Dataset, DatasetItem, DatasetVersion

FORMATS = ("openai", "vllm", "sharegpt")
MAX_ITEM_BYTES = 256 * 1024
MAX_ITEMS = 100_000
MAX_FILE_BYTES = 512 * 1024 * 1024
MAX_PROBLEMS = 50
DATASET_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,99}$")  # apikit.inputs.SLUG_PATTERN
ITEM_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
ROLES = ("system", "developer", "user", "assistant", "tool")
# Request parameters an item may set; the runner owns model, stream, n and the stream options.
PARAMS = {
    "max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int, "min_tokens": int,
    "stop": (str, list), "seed": int, "ignore_eos": bool, "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "repetition_penalty": (int, float), "response_format": dict,
}
ITEM_KEYS = {"id", "messages", "prompt", "params", "expected", "evaluators", "tags", "metadata"}
DEFAULT_MAX_TOKENS = 256


class DatasetError(ValueError):
    """Items that cannot be stored; `problems` lists each ("line 3: ...")."""

    def __init__(self, problems: list[str]):
        self.problems = problems[:MAX_PROBLEMS]
        more = len(problems) - len(self.problems)
        text = "; ".join(self.problems) + (f"; and {more} more" if more > 0 else "")
        super().__init__(text)


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content}"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object"
        if message.get("role") not in ROLES:
            return f"messages[{index}].role must be one of {', '.join(ROLES)}"
        content = message.get("content")
        if not isinstance(content, str):
            return f"messages[{index}].content must be a string"
        extra = set(message) - {"role", "content", "name"}
        if extra:
            return f"messages[{index}] has unknown keys {', '.join(sorted(extra))}"
    return None


def _check_params(params: Any) -> str | None:
    if not isinstance(params, dict):
        return "params must be an object"
    for key, value in params.items():
        kind = PARAMS.get(key)
        if kind is None:
            return f"params.{key} is not a request parameter a run may set (allowed: {', '.join(sorted(PARAMS))})"
        if isinstance(value, bool) and kind is not bool:
            return f"params.{key} has the wrong type"
        if not isinstance(value, kind):
            return f"params.{key} has the wrong type"
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and not 1 <= max_tokens <= 1_000_000:
        return "params.max_tokens must be between 1 and 1000000"
    return None


def _text_problem(text: str, where: str) -> str | None:
    if "\x00" in text:
        return f"{where} holds a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return f"{where} holds text that is not valid Unicode (a lone surrogate)"
    return None


def json_problem(value: Any, where: str, depth: int = 0) -> str | None:
    """Why a free-form JSON value (metadata, a JSON Schema, response_format, an engine config) cannot be stored and
    served back: a number beyond 64 bits (JSON allows it; the API's encoder does not, and PostgreSQL's jsonb
    writes a float such as 1e300 back as a 301-digit integer), text with NUL or lone surrogates (PostgreSQL's
    jsonb refuses them), or nesting deeper than 32."""
    if depth > 32:
        return f"{where} is nested too deeply (32 levels at most)"
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        return _text_problem(value, where)
    if isinstance(value, int):
        return None if -(2**63) <= value < 2**64 else f"{where} holds an integer beyond 64 bits"
    if isinstance(value, float):
        return None if abs(value) < 2.0**63 else f"{where} holds a number beyond 64 bits"
    if isinstance(value, dict):
        for key, inner in value.items():
            problem = _text_problem(str(key), where) or json_problem(inner, where, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, list):
        for inner in value:
            problem = json_problem(inner, where, depth + 1)
            if problem:
                return problem
    return None


def clean_item(data: Any, default_id: str) -> dict:
    """One item checked and normalised; raises ValueError with the reason."""
    if not isinstance(data, dict):
        raise ValueError("an item must be a JSON object")
    unknown = set(data) - ITEM_KEYS
    if unknown:
        raise ValueError(f"unknown keys {', '.join(sorted(unknown))} (an item has {', '.join(sorted(ITEM_KEYS))})")
    item_id = data.get("id", default_id)
    if isinstance(item_id, int) and not isinstance(item_id, bool):
        item_id = str(item_id)
    if not isinstance(item_id, str) or not ITEM_ID.match(item_id):
        raise ValueError("id must be 1-200 characters: letters, digits and ._:/@+- (starting with a letter or digit)")
    has_messages, has_prompt = data.get("messages") is not None, data.get("prompt") is not None
    if has_messages == has_prompt:
        raise ValueError("an item has either messages or prompt (exactly one)")
    if has_messages:
        problem = _check_messages(data["messages"])
        if problem:
            raise ValueError(problem)
    elif not isinstance(data["prompt"], str) or not data["prompt"]:
        raise ValueError("prompt must be a non-empty string")
    params = data.get("params") or {}
    problem = _check_params(params)
    if problem:
        raise ValueError(problem)
    expected = data.get("expected")
    if expected is not None and not isinstance(expected, str):
        raise ValueError("expected must be a string")
    evaluators = data.get("evaluators") or []
    try:
        evaluators = check_evaluators(evaluators)
    except EvaluatorError as exc:
        raise ValueError(str(exc)) from None
    tags = data.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) and 0 < len(t) <= 100 for t in tags) or len(tags) > 50:
        raise ValueError("tags must be a list of at most 50 strings of 1-100 characters")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError("metadata must be an object")
    for name, value in (("metadata", metadata), ("params", params), ("evaluators", evaluators)):
        problem = json_problem(value, name)
        if problem:
            raise ValueError(problem)
    item = {"id": item_id, "params": params, "evaluators": evaluators, "tags": tags, "metadata": metadata}
    if has_messages:
        item["messages"] = [dict(m) for m in data["messages"]]
    else:
        item["prompt"] = data["prompt"]
    if expected is not None:
        item["expected"] = expected
    size = len(json.dumps(item, ensure_ascii=False).encode("utf-8"))
    if size > MAX_ITEM_BYTES:
        raise ValueError(f"the item is {size} bytes; the limit is {MAX_ITEM_BYTES}")
    return item


def clean_items(entries: Iterable[tuple[str, Any, str]]) -> list[dict]:
    """(where, data, default id) → items; every problem reported together, duplicates ids included."""
    items: list[dict] = []
    problems: list[str] = []
    seen: dict[str, str] = {}
    for where, data, default_id in entries:
        try:
            item = clean_item(data, default_id)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if item["id"] in seen:
            problems.append(f"{where}: id {item['id']!r} repeats {seen[item['id']]}")
            continue
        seen[item["id"]] = where
        items.append(item)
        if len(items) > MAX_ITEMS:
            problems.append(f"more than {MAX_ITEMS} items")
            break
    if problems:
        raise DatasetError(problems)
    if not items:
        raise DatasetError(["no items"])
    return items


_TOP_LEVEL_PARAMS = tuple(PARAMS)


def _from_openai(obj: Any, number: int) -> Any:
    if not isinstance(obj, dict):
        return obj
    obj = dict(obj)
    params = dict(obj.pop("params", None) or {}) if isinstance(obj.get("params", {}), dict) else obj.pop("params")
    if isinstance(params, dict):
        for key in _TOP_LEVEL_PARAMS:
            if key in obj:
                params[key] = obj.pop(key)
    if "ideal" in obj and "expected" not in obj:
        ideal = obj.pop("ideal")
        obj["expected"] = ideal[0] if isinstance(ideal, list) and ideal else ideal
    messages = obj.get("messages")
    if (isinstance(messages, list) and len(messages) > 1 and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "assistant" and "expected" not in obj):
        obj["messages"] = messages[:-1]
        obj["expected"] = messages[-1].get("content")
    obj["params"] = params
    return obj


def _from_vllm(obj: Any, number: int) -> Any:
    if not isinstance(obj, dict):
        return obj
    obj = dict(obj)
    params = {}
    for key in ("output_tokens", "output_len", "max_tokens"):
        if key in obj:
            params["max_tokens"] = obj.pop(key)
    for key in ("completion", "output"):
        if key in obj and "expected" not in obj:
            obj["expected"] = obj.pop(key)
    if params:
        obj["params"] = {**(obj.get("params") or {}), **params}
    return obj


def _sharegpt_entry(entry: Any) -> Any:
    if not isinstance(entry, dict):
        raise ValueError("an entry must be an object with conversations")
    turns = entry.get("conversations")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ValueError("conversations must be a list of {from, value}")
    messages = []
    index = 0
    if turns and turns[0].get("from") == "system":
        messages.append({"role": "system", "content": turns[0].get("value")})
        index = 1
    if len(turns) < index + 2 or turns[index].get("from") != "human" or turns[index + 1].get("from") != "gpt":
        raise ValueError("needs a human turn followed by a gpt turn")
    prompt, reply = turns[index].get("value"), turns[index + 1].get("value")
    if not isinstance(prompt, str) or not isinstance(reply, str):
        raise ValueError("turn values must be strings")
    messages.append({"role": "user", "content": prompt})
    item = {"messages": messages, "expected": reply, "params": {"max_tokens": max(1, count_tokens(reply))}}
    if entry.get("id") is not None:
        item["id"] = entry["id"]
    return item


def parse_file(data: bytes, fmt: str) -> list[dict]:
    """The items of a file in `fmt`; raises DatasetError listing every bad line (nothing is kept)."""
    if fmt not in FORMATS:
        raise DatasetError([f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}"])
    if len(data) > MAX_FILE_BYTES:
        raise DatasetError([f"the file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB"])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DatasetError([f"line {line}: not valid UTF-8"]) from None
    if fmt == "sharegpt":
        try:
            entries = json.loads(text)
        except ValueError as exc:
            raise DatasetError([f"line {getattr(exc, 'lineno', '?')}: not JSON ({exc})"]) from None
        if not isinstance(entries, list):
            raise DatasetError(["a ShareGPT file is a JSON array of conversations"])
        converted, problems = [], []
        for number, entry in enumerate(entries, 1):
            try:
                converted.append((f"entry {number}", _sharegpt_entry(entry), f"item-{number}"))
            except ValueError as exc:
                problems.append(f"entry {number}: {exc}")
        if problems:
            raise DatasetError(problems)
        return clean_items(converted)
    convert = _from_openai if fmt == "openai" else _from_vllm
    entries, problems = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(line) > 4 * MAX_ITEM_BYTES:
            problems.append(f"line {number}: longer than the item limit ({MAX_ITEM_BYTES} bytes)")
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg if hasattr(exc, 'msg') else exc})")
            continue
        entries.append((f"line {number}", convert(obj, number), f"item-{number}"))
    if problems:
        # Report the lines that parsed but are wrong as well.
        try:
            clean_items(entries)
        except DatasetError as exc:
            problems.extend(exc.problems)
        problems.sort(key=lambda p: int(p.split(":")[0].split()[1]) if p.startswith("line ") else 0)
        raise DatasetError(problems)
    return clean_items(entries)


def write_version(project, name: str, items: list[dict], *, source: str, created_by: str = "", note: str = "",
                  replace: bool = False, delete: Iterable[str] = (), description: str | None = None
                  ) -> DatasetVersion:
    """A new version of dataset `name` (created if missing): the last version's items upserted with `items`
    (replaced entirely with replace=True), minus the ids in `delete`.

    In one transaction that writes before it reads: on SQLite (embedded mode) a transaction that read first and
    then writes fails at once ("database is locked") when another connection wrote meanwhile (the worker
    recording a run); taking the write lock first makes it wait its turn instead."""
    for attempt in range(3):
        try:
            with transaction.atomic():
                # The write lock first (the dataset's row, or the database on SQLite); a no-op change.
                Dataset.objects.filter(project=project, name=name).update(name=name)
                return _write_version(project, name, items, source=source, created_by=created_by, note=note,
                                      replace=replace, delete=delete, description=description)
        except OperationalError as exc:
            if "locked" not in str(exc) or attempt == 2:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _write_version(project, name: str, items: list[dict], *, source: str, created_by: str, note: str,
                   replace: bool, delete: Iterable[str], description: str | None) -> DatasetVersion:
    if not DATASET_NAME.match(name or ""):
        raise DatasetError([f"dataset name {name!r}: lowercase letters, digits, '-' and '_', starting with a "
                            "letter or digit (at most 100)"])
    dataset, _ = Dataset.objects.select_for_update().get_or_create(project=project, name=name)
    if description is not None:
        dataset.description = description
        dataset.save(update_fields=["description"])
    previous = dataset.latest()
    merged: dict[str, dict] = {}
    if previous is not None and not replace:
        merged = {item.item_id: item.as_dict() for item in previous.items.all()}
    for item_id in delete:  # an id that is not there is already deleted
        merged.pop(item_id, None)
    for item in items:
        merged[item["id"]] = item
    if not merged:
        raise DatasetError(["a version must hold at least one item"])
    if len(merged) > MAX_ITEMS:
        raise DatasetError([f"a version holds at most {MAX_ITEMS} items"])
    version = DatasetVersion.objects.create(
        dataset=dataset, number=(previous.number + 1) if previous else 1, created_by=created_by, source=source[:200],
        note=note[:500], item_count=len(merged))
    DatasetItem.objects.bulk_create(
        [DatasetItem(version=version, position=position, item_id=item["id"], messages=item.get("messages"),
                     prompt=item.get("prompt"), params=item.get("params") or {}, expected=item.get("expected"),
                     evaluators=item.get("evaluators") or [], tags=item.get("tags") or [],
                     metadata=item.get("metadata") or {})
         for position, item in enumerate(merged.values())],
        batch_size=1000)
    return version


def resolve_version(project, name: str, version: int | None = None) -> DatasetVersion:
    """The version `version` (default: the latest) of dataset `name`; LookupError with the reason."""
    dataset = Dataset.objects.filter(project=project, name=name).first()
    if dataset is None:
        raise LookupError(f"no dataset named {name!r} in project {project.name}")
    if version is None:
        found = dataset.latest()
        if found is None:
            raise LookupError(f"dataset {name!r} has no version")
        return found
    found = dataset.versions.filter(number=version).first()
    if found is None:
        numbers = list(dataset.versions.values_list("number", flat=True))
        raise LookupError(f"dataset {name!r} has no version {version} (versions: "
                          f"{', '.join(map(str, numbers)) or 'none'})")
    return found


def traffic_items(store, project_id: int, *, since, until, size: int, seed: int = 0,
                  max_prompt_tokens: int = 32_000) -> list[dict]:
    """`size` synthetic items shaped like the project's traffic in [since, until): per prompt bucket, as many
    items as its share of requests, each with the prompt and output lengths of a request drawn from that
    bucket (synthetic text of that many tokens; max_tokens = its output tokens, ignore_eos so the length holds)."""
    rows = queries.traffic_lengths(store, project_id, since=since, until=until)
    if not rows:
        raise DatasetError(["no completed requests with token counts in that time range"])
    by_bucket: dict[str, list[tuple[int, int]]] = {}
    for bucket, prompt_tokens, completion_tokens in rows:
        by_bucket.setdefault(bucket, []).append((int(prompt_tokens), int(completion_tokens)))
    rng = random.Random(seed)
    total = len(rows)
    # Largest remainder: the buckets' shares of `size`, every bucket that had traffic at least one item.
    shares = {b: size * len(v) / total for b, v in by_bucket.items()}
    counts = {b: max(1, int(s)) for b, s in shares.items()}
    for b in sorted(shares, key=lambda b: shares[b] - int(shares[b]), reverse=True):
        if sum(counts.values()) >= size:
            break
        counts[b] += 1
    items = []
    for bucket in sorted(counts):
        for n in range(counts[bucket]):
            prompt_tokens, completion_tokens = rng.choice(by_bucket[bucket])
            prompt_tokens = min(prompt_tokens, max_prompt_tokens)
            items.append({
                "id": f"traffic-{len(items) + 1}",
                "prompt": synthetic_text(max(1, prompt_tokens), rng),
                "params": {"max_tokens": max(1, completion_tokens), "ignore_eos": True},
                "evaluators": [], "tags": ["traffic", f"bucket:{bucket}"],
                "metadata": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "prompt_bucket": bucket},
            })
    return clean_items((f"item {i + 1}", item, item["id"]) for i, item in enumerate(items))
