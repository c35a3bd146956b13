"""A regression run's cache sweep (issue 40): the report's arithmetic, and the threshold measured through the live
fleet's gateway on a golden set of questions, paraphrases and near misses."""
from __future__ import annotations

import http.cookiejar
import json
import re
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
from browser_support import dashboard_login
from fleet_support import LLAMA_8B_H100
from regressions import cache_sweep

from engine.replica.embeddings import embed_text


def result(item: str, served_from: str = "engine", passed: bool | None = True, similarity: float | None = None,
           success: bool = True, error: str = "") -> dict:
    return {"item_id": item, "success": success, "served_from": served_from, "passed": passed,
            "similarity": similarity, "error": error}


@pytest.mark.mode_independent
def test_the_report_counts_hits_and_false_hits_against_the_items_evaluators():
    baseline = [result("a"), result("b"), result("c", passed=False), result("d", passed=None)]
    low = [result("a"), result("b", "semantic_cache", similarity=0.91), result("c", "semantic_cache", passed=False,
                                                                              similarity=0.82),
           result("d", "semantic_cache", passed=None, similarity=0.8), result("e", "exact_cache", similarity=1.0)]
    high = [result("a"), result("b", "semantic_cache", similarity=0.91), result("c"), result("d"),
            result("e", success=False, passed=None, error="refused")]
    none = [result("a"), result("b"), result("c"), result("d"), result("e")]
    report = cache_sweep.report(baseline, [(0.95, none), (0.8, low), (0.9, high)], 1.0)
    assert report["baseline"] == {"requests": 4, "errors": 0, "hits": 0, "pass_rate": pytest.approx(100 * 2 / 3),
                                  "evaluated": 3}
    rows = {row["threshold"]: row for row in report["thresholds"]}
    assert [row["threshold"] for row in report["thresholds"]] == [0.8, 0.9, 0.95]
    # 0.8: 4 of 5 answers from the cache; the hit of d (no evaluator) cannot be judged; c's answer fails its own.
    assert {k: rows[0.8][k] for k in ("requests", "errors", "hits", "semantic_hits", "exact_hits", "judged_hits",
                                      "false_hits", "false_hit_items")} == {
        "requests": 5, "errors": 0, "hits": 4, "semantic_hits": 3, "exact_hits": 1, "judged_hits": 3,
        "false_hits": 1, "false_hit_items": ["c"]}
    assert rows[0.8]["hit_ratio"] == 80.0 and rows[0.8]["false_hit_rate"] == pytest.approx(100 / 3)
    assert rows[0.8]["hit_similarity_min"] == 0.8 and rows[0.8]["false_hit_similarity_max"] == 0.82
    # 0.9: the failed request is an error, not a request answered: hit ratio 1 of 4.
    assert (rows[0.9]["errors"], rows[0.9]["hit_ratio"], rows[0.9]["false_hit_rate"]) == (1, 25.0, 0.0)
    assert rows[0.9]["first_error"] == "refused"
    assert (rows[0.95]["hits"], rows[0.95]["hit_ratio"], rows[0.95]["false_hit_rate"]) == (0, 0.0, None)
    assert report["recommended_threshold"] == 0.9
    assert report["recommendation"].startswith("recommended threshold 0.9: the lowest whose false-hit rate (0.0%) "
                                               "is within 1%")
    # A looser bound takes the lower threshold; a bound nothing meets is said plainly.
    assert cache_sweep.report(baseline, [(0.8, low), (0.9, high)], 40.0)["recommended_threshold"] == 0.8
    strict = cache_sweep.report(baseline, [(0.8, low)], 1.0)
    assert strict["recommended_threshold"] is None
    assert "no threshold qualifies: every threshold that served hits had a false-hit rate above 1% (at 0.8: " \
           "33.3%, 1 of 3 hits)" in strict["recommendation"]
    assert "no threshold served a hit" in cache_sweep.report(baseline, [(0.9, none)], 1.0)["recommendation"]
    failed = [result("a", success=False, passed=None, error="400: not allowed")]
    assert "every request of the sweep failed (400: not allowed)" in \
           cache_sweep.report(baseline, [(0.9, failed)], 1.0)["recommendation"]
    lines = cache_sweep.report_lines(report)
    assert "false-hit rate" in lines[1] and lines[2].split() == ["0.8", "5", "0", "4", "80.0%", "1", "33.3%"]

    assert cache_sweep.clean({"thresholds": [0.95, 0.8, 1]}) == (
        {"thresholds": [0.8, 0.95, 1.0], "max_false_hit_rate": 1.0}, [])
    for bad, reason in (([], "a list of 1 to 20"), ([0], "not a number in (0, 1]"), ([1.5], "(0, 1]"),
                        ([0.12345], "at most 4 decimals"), ([True], "(0, 1]"), ([0.9, 0.9], "given twice"),
                        ("0.9", "a list"), ([float("nan")], "(0, 1]"), ([{}], "(0, 1]")):
        assert reason in "; ".join(cache_sweep.clean({"thresholds": bad})[1]), bad
    assert "unknown keys size" in cache_sweep.clean({"thresholds": [0.9], "size": 1})[1][0]
    assert "percentage" in cache_sweep.clean({"thresholds": [0.9], "max_false_hit_rate": 101})[1][0]


# The golden set: six questions, each with paraphrases (the same question: its answer is right) and a near miss (a
# question that shares most of its words but needs another answer). Cosines of the simulator's stand-in embeddings
# (bag of words and trigrams) to the question: paraphrases 0.74-1.0, near misses 0.81-0.89, other questions < 0.5.
QUESTIONS = (
    ("france", "What is the capital of France?",
     ("What is the capital city of France?", "Tell me the capital of France."), "What is the capital of Germany?"),
    ("spider", "How many legs does a spider have?",
     ("How many legs do spiders have?", "A spider has how many legs?"), "How many eyes does a spider have?"),
    ("moby", "Who wrote the novel Moby Dick?", ("Who was the writer of the novel Moby Dick?",),
     "Who illustrated the novel Moby Dick?"),
    ("water", "What is the boiling point of water at sea level?",
     ("At sea level, what is the boiling point of water?", "What's the boiling point of water at sea level?"),
     "What is the boiling point of ethanol at sea level?"),
    ("python", "How do I reverse a list in Python?", ("How can I reverse a Python list?",),
     "How do I sort a list in Python?"),
    ("war", "What year did the Second World War end?",
     ("In what year did the Second World War end?", "When did World War Two end?"),
     "What year did the First World War end?"),
)
THRESHOLDS = (0.8, 0.85, 0.9, 0.95)


def golden_texts() -> list[tuple[str, str, str]]:
    """(item id, question text, class) in dataset order: a question, its paraphrases, its near miss (a class of
    its own)."""
    out = []
    for name, question, paraphrases, near in QUESTIONS:
        out.append((name, question, name))
        out.extend((f"{name}-p{n}", text, name) for n, text in enumerate(paraphrases, start=1))
        out.append((f"{name}-near", near, f"{name}-near"))
    return out


def expected_pass(threshold: float) -> dict[str, tuple[float | None, bool, bool]]:
    """What one pass must find, worked out here from the stand-in embeddings alone: item → (best similarity to what
    the pass stored before it, hit, false hit). A miss stores its answer; a hit serves the stored answer closest to
    it, which is right only when it answers the same question."""
    stored: list[tuple[np.ndarray, str]] = []
    out = {}
    for item, text, kind in golden_texts():
        vector = embed_text(text)
        scores = [(float(np.dot(vector, other)), other_kind) for other, other_kind in stored]
        best = max(scores, key=lambda s: s[0]) if scores else None
        hit = best is not None and best[0] >= threshold
        out[item] = (best[0] if best else None, hit, hit and best[1] != kind)
        if not hit:
            stored.append((vector, kind))
    return out


def post(url: str, body: dict, headers: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def admin_routes(gateway: str, token: str, document: dict | None = None) -> dict:
    request = urllib.request.Request(gateway + "/admin/routes", method="PUT" if document else "GET",
                                     data=json.dumps(document).encode() if document else None,
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc}: {exc.read()[:1000]!r}") from None


def dashboard_page(live, path: str) -> str:
    """A dashboard page as an operator sees it (logged in through the login form)."""
    password = dashboard_login(live.process, "sweep-viewer", "viewer")
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    login = live.process.url + "/accounts/login/"
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', opener.open(login).read().decode()).group(1)
    opener.open(urllib.request.Request(login, headers={"Referer": login}, data=urllib.parse.urlencode({
        "csrfmiddlewaretoken": token, "username": "sweep-viewer", "password": password}).encode()))
    return opener.open(live.process.url + path).read().decode()


# Once, in the server suite: what it tests is the gateway's cache and the sweep's report, not the metadata store
# (the run's options and results are plain columns either way), and it takes ~35 s of a CI near its budget.
@pytest.mark.one_suite(suite="server")
def test_a_threshold_sweep_through_the_fleets_gateway_reports_hits_and_false_hits(live, tmp_path):
    """The simulator's answers are synthetic text fixed by the prompt (greedy: the same prompt, the same words), so
    a paraphrase's own answer differs from its question's. The golden set therefore takes the engine's answers to
    every wording of a question as that question's right answers (asked first, through the group with no cache):
    each item's evaluator accepts exactly its class's answers (a regex of them), so a paraphrase served its
    question's answer passes, and a near miss served another question's answer fails: a false hit. The expected
    hits and false hits of every pass are worked out here from the stand-in embeddings alone (expected_pass)."""
    gateway = f"http://127.0.0.1:{live.gateway}"
    token = (live.root / "engine" / "gateway.token").read_text().strip()
    routes = admin_routes(gateway, token)
    embeddings = next(g for g in routes["groups"] if g["name"] == "base")["upstreams"][0]["url"] + "/v1/embeddings"
    model = LLAMA_8B_H100["model"]
    texts = golden_texts()
    answers = {item: post(gateway + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 6},
        {"X-Engine-Group": "same"})["choices"][0]["message"]["content"] for item, text, _ in texts}
    right = {}
    for item, _, kind in texts:
        right.setdefault(kind, []).append(answers[item])
    assert len(set(answers.values())) == len(texts), answers  # every wording gets its own synthetic answer
    items = [{"id": item, "messages": [{"role": "user", "content": text}], "params": {"max_tokens": 6},
              "evaluators": [{"type": "regex", "pattern": "^(?:" + "|".join(map(re.escape, right[kind])) + ")$"}]}
             for item, text, kind in texts]
    status, body = live.api("POST", "/api/v1/datasets", {"name": "cache-sweep", "items": items})
    assert status == 201, body

    cache = {"semantic": {"enabled": True, "embeddings_url": embeddings, "model": model, "threshold": 0.99,
                          "client_threshold": True}}
    def set_cache(value):  # the groups listed are the new table: every group, the others as they are
        admin_routes(gateway, token, {"groups": [{"name": g["name"], **({"cache": value} if g["name"] == "same"
                                                                        else {})} for g in routes["groups"]]})
    set_cache(cache)
    try:
        out = tmp_path / "sweep.json"
        rc, text = live.cli("regression", "run", "--project", "default", "--dataset", "cache-sweep", "--target",
                            "group:same", "--cache-sweep", ",".join(map(str, THRESHOLDS)), "--json", str(out))
    finally:
        set_cache(None)
    assert rc == 0, text
    document = json.loads(out.read_text())
    report = document["cache_sweep"]
    assert report["baseline"] == {"requests": 22, "errors": 0, "hits": 0, "pass_rate": 100.0, "evaluated": 22}
    rows = report["thresholds"]
    assert [row["threshold"] for row in rows] == list(THRESHOLDS)
    for row in rows:
        expected = expected_pass(row["threshold"])
        hits = sorted(item for item, (_, hit, _) in expected.items() if hit)
        false = sorted(item for item, (_, _, wrong) in expected.items() if wrong)
        assert (row["requests"], row["errors"], row["hits"], row["semantic_hits"]) == (22, 0, len(hits), len(hits))
        assert row["false_hits"] == len(false) and row["false_hit_items"] == false, (row, false)
        assert row["hit_ratio"] == pytest.approx(100 * len(hits) / 22)
        assert row["false_hit_rate"] == pytest.approx(100 * len(false) / len(hits))
        status, page = live.api("GET", f"/api/v1/regression-runs/{document['run_id']}/results?arm="
                                       f"{cache_sweep.arm_of(row['threshold'])}&limit=100")
        assert status == 200 and page["total"] == 22
        for found in page["results"]:
            similarity, hit, wrong = expected[found["item_id"]]
            assert found["served_from"] == ("semantic_cache" if hit else "engine"), found
            assert found["passed"] is (not wrong), found
            if hit:  # a hit's row is complete only with the gateway's span, which holds the similarity
                assert found["similarity"] == pytest.approx(similarity, abs=1e-4), found
    # The trade-off: the lower the threshold, the more hits and the more of them wrong.
    assert [row["hits"] for row in rows] == [11, 7, 4, 2]
    assert [row["false_hits"] for row in rows] == [6, 3, 0, 0]
    assert report["recommended_threshold"] == 0.9
    assert "recommended threshold 0.9: the lowest whose false-hit rate (0.0%) is within 1%" in text
    assert "false-hit rate" in text and "cache sweep (semantic threshold)" in text

    status, run = live.api("GET", f"/api/v1/regression-runs/{document['run_id']}")
    assert status == 200 and run["summary"]["cache_sweep"] == report
    assert run["options"]["cache_sweep"] == {"thresholds": list(THRESHOLDS), "max_false_hit_rate": 1.0}
    for options, extra, reason in (({"thresholds": [0.9]}, {"baseline": "group:base"}, "no paired baseline"),
                                   ({"thresholds": [1.5]}, {}, "less than or equal to 1"),
                                   ({"thresholds": [0.12345]}, {}, "at most 4 decimals")):
        status, body = live.api("POST", "/api/v1/regression-runs", {
            "dataset": "cache-sweep", "target": "group:same", "options": {"cache_sweep": options}, **extra})
        assert status == 400 and reason in json.dumps(body), body
    page = dashboard_page(live, f"/regressions/runs/{document['run_id']}/")
    table = page[page.index('data-testid="cache-sweep"'):]
    assert "<td>france-near, moby-near" in table and "recommended threshold 0.9" in table
