"""Tenant isolation and credentials: an ingest key writes only into its project, an API token reads only its
projects, the two kinds of credential are not interchangeable, and secrets are stored only as hashes.

The first half runs against a live platform (real HTTP, real gRPC); the second half drives the management
commands and the ORM directly (pytest-django `db`)."""
from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from otlp_payloads import (
    CLIENT,
    MS,
    api,
    engine_span,
    export_protobuf,
    grpc_auth,
    grpc_export_raw,
    pb_request,
    pb_span,
    post_traces,
    requests_of,
    vllm_resource,
)

ENDPOINTS = ("/api/v1/requests?trace_id=" + "ab" * 16, "/api/v1/latency/summary")


def send(platform, project: str, **span_kwargs) -> str:
    span = engine_span(**span_kwargs)
    export_protobuf(platform, pb_request((vllm_resource(), [span])), platform.keys[project])
    return span.trace_id.hex()


@pytest.fixture(scope="module")
def traces(live_platform):
    """One request per project, sharing a model name so that only the project can tell them apart."""
    model = f"shared-model-{uuid.uuid4().hex[:8]}"
    alpha = send(live_platform, "alpha", model=model, e2e_s=0.25, decode_s=0.2)
    beta = send(live_platform, "beta", model=model, e2e_s=0.75, decode_s=0.6)
    live_platform.process.wait_idle()
    return {"model": model, "alpha": alpha, "beta": beta}


def test_ingest_key_writes_only_into_its_project(live_platform, traces):
    alice, bob = live_platform.tokens["alice"], live_platform.tokens["bob"]
    [row] = requests_of(live_platform, traces["alpha"], alice)
    assert row["e2e_ms"] == pytest.approx(250.0, abs=0.001)
    assert requests_of(live_platform, traces["alpha"], bob) == []
    [row] = requests_of(live_platform, traces["beta"], bob)
    assert row["e2e_ms"] == pytest.approx(750.0, abs=0.001)
    assert requests_of(live_platform, traces["beta"], alice) == []
    # naming the project explicitly changes nothing
    assert len(requests_of(live_platform, traces["alpha"], alice, project="alpha")) == 1


def test_same_trace_and_span_ids_in_two_projects_stay_apart(live_platform):
    """Trace and span ids are chosen by clients, so another tenant can send the very same ids (by accident or
    on purpose): each project keeps its own spans, its own request row and its own figures, and a span of one
    project never joins a chain in the other."""
    trace_id, client_id, engine_id = os.urandom(16), os.urandom(8), os.urandom(8)
    now = time.time_ns() - 3_000 * MS
    client = pb_span(trace_id, client_id, name="chat", kind=CLIENT, start_ns=now, end_ns=now + 700 * MS,
                     attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"})
    export_protobuf(live_platform, pb_request(({"service.name": "alpha-app"}, [client])), live_platform.keys["alpha"])
    for project, e2e in (("alpha", 0.5), ("beta", 0.25)):
        engine = engine_span(trace_id=trace_id, span_id=engine_id, parent=client_id, start_ns=now + 50 * MS,
                             e2e_s=e2e, decode_s=e2e / 2, model=f"{project}-model")
        export_protobuf(live_platform, pb_request((vllm_resource(f"{project}-vllm"), [engine])),
                        live_platform.keys[project])
    live_platform.process.wait_idle()

    [alpha] = requests_of(live_platform, trace_id.hex(), live_platform.tokens["alice"])
    [beta] = requests_of(live_platform, trace_id.hex(), live_platform.tokens["bob"])
    assert (alpha["model"], beta["model"]) == ("alpha-model", "beta-model")
    assert [h["role"] for h in alpha["hops"]] == ["client", "engine"]
    assert alpha["e2e_ms"] == pytest.approx(700.0, abs=0.001)
    assert alpha["network_ms"] == pytest.approx(200.0, abs=0.001)
    # beta's engine span names a parent that only exists in alpha: beta sees an engine-only request
    assert [h["role"] for h in beta["hops"]] == ["engine"]
    assert beta["e2e_ms"] == pytest.approx(250.0, abs=0.001)
    assert beta["network_ms"] is None and beta["service"] == "beta-vllm"


def test_summary_over_rollups_stays_per_project(fresh_platform_factory):
    """Long ranges are answered from hourly/daily rollups merged with raw rows: the merge, too, must only
    ever see the reader's project, and count what the exact (raw-rows-only) summary counts."""
    platform = fresh_platform_factory(extra_env={"ROLLUP_INTERVAL_SECONDS": "0.2", "ROLLUP_SETTLE_SECONDS": "0"})
    model = "rollup-model"
    now = time.time_ns()
    starts = [now - 50 * 3600 * 10**9, now - 3 * 3600 * 10**9, now - 3 * 3600 * 10**9 + 600 * 10**9, now - 10**10]
    for project, e2e in (("alpha", 0.1), ("beta", 0.3)):
        spans = [engine_span(model=model, start_ns=start, e2e_s=e2e, decode_s=e2e / 2) for start in starts]
        # two replica groups, so grouping by them goes through the rollups too (the day-old request in "blue")
        export_protobuf(platform, pb_request((vllm_resource(replica_group="blue"), spans[::2]),
                                             (vllm_resource(replica_group="green"), spans[1::2])),
                        platform.keys[project])
    platform.process.wait_idle()
    time.sleep(2)  # several rollup rounds: the closed hours and the closed day are rolled up by now
    since = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)).isoformat().replace("+00:00", "Z")
    for token, e2e in (("alice", 100.0), ("bob", 300.0)):
        for exact in ("0", "1"):
            status, body = api(platform, f"/api/v1/latency/summary?group_by=model&since={since}&exact={exact}",
                               platform.tokens[token])
            assert status == 200, body
            [group] = body["groups"]
            assert group["count"] == len(starts), (token, exact, group)
            assert group["e2e_ms"]["p50"] == pytest.approx(e2e, abs=0.001), (token, exact)
            assert group["e2e_ms"]["p99"] == pytest.approx(e2e, abs=0.001), (token, exact)
            status, body = api(platform, f"/api/v1/latency/summary?group_by=replica_group&since={since}"
                               f"&exact={exact}", platform.tokens[token])
            assert status == 200, body
            assert {g["key"]["replica_group"]: g["count"] for g in body["groups"]} == {"blue": 2, "green": 2}


@pytest.mark.parametrize("path", ["/api/v1/requests?trace_id={trace}&project={project}",
                                  "/api/v1/latency/summary?project={project}"])
def test_other_projects_are_not_found(live_platform, traces, path):
    for token, project in (("bob", "alpha"), ("alice", "beta"), ("alice", "gamma"), ("alice", "")):
        status, body = api(live_platform, path.format(trace=traces["alpha"], project=project),
                           live_platform.tokens[token])
        # An empty name is no project name at all: 400 naming `project`; any other is 404 (not revealed).
        assert status == (400 if project == "" else 404), (token, project, body)
        assert body["error"]
        assert "requests" not in body and "groups" not in body


def test_latency_summary_counts_only_the_readers_project(live_platform, traces):
    path = f"/api/v1/latency/summary?group_by=model&model={traces['model']}&exact=1"
    for token, e2e in (("alice", 250.0), ("bob", 750.0)):
        status, body = api(live_platform, path, live_platform.tokens[token])
        assert status == 200, body
        [group] = body["groups"]
        assert group["count"] == 1, token
        assert group["e2e_ms"]["p50"] == pytest.approx(e2e, abs=0.001), token


def test_token_of_several_projects_must_name_one(live_platform, traces):
    token = live_platform.process.manage("create_api_token", "--user", f"erin-{uuid.uuid4().hex[:6]}",
                                         "--project", "alpha", "--project", "beta")
    status, body = api(live_platform, "/api/v1/latency/summary", token)
    assert status == 400 and "project" in body["error"]
    # A trace id names one trace whatever the project: without ?project= the token's projects are searched, and
    # each row says which it belongs to (never a project the token does not read).
    status, body = api(live_platform, f"/api/v1/requests?trace_id={traces['alpha']}", token)
    assert status == 200 and [r["project"] for r in body["requests"]] == ["alpha"], body
    assert len(requests_of(live_platform, traces["alpha"], token, project="alpha")) == 1
    assert requests_of(live_platform, traces["alpha"], token, project="beta") == []
    assert len(requests_of(live_platform, traces["beta"], token, project="beta")) == 1


def test_token_without_a_project_is_403(live_platform):
    user = f"nobody-{uuid.uuid4().hex[:6]}"
    token = live_platform.process.manage("create_api_token", "--user", user, "--project", "alpha")
    live_platform.process.manage(
        "shell", "-c",
        f"from tenancy.models import Membership; Membership.objects.filter(user__username={user!r}).delete()",
    )
    for path in ENDPOINTS:
        status, body = api(live_platform, path, token)
        assert status == 403, (path, body)
        assert body["error"]


@pytest.mark.parametrize("authorization", [None, "Bearer", "Bearer lot_" + "z" * 43, "Basic YWxpY2U6c2VjcmV0",
                                           "Token {alice}", "{alice}", "Bearer {alice}x", "Bearer " + "t" * 500])
def test_missing_or_invalid_api_token_is_401(live_platform, authorization):
    for path in ENDPOINTS:
        headers = {}
        if authorization is not None:
            headers["Authorization"] = authorization.format(alice=live_platform.tokens["alice"])
        request = urllib.request.Request(live_platform.url + path, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as failure:
            urllib.request.urlopen(request, timeout=30)
        assert failure.value.code == 401
        assert failure.value.headers["Content-Type"].startswith("application/json")
        assert json.loads(failure.value.read())["error"]


def test_ingest_key_is_not_an_api_token(live_platform):
    for path in ENDPOINTS:
        status, body = api(live_platform, path, live_platform.keys["alpha"])
        assert status == 401 and body["error"]


def test_api_token_is_not_an_ingest_key(live_platform):
    span = engine_span()
    body = pb_request((vllm_resource(), [span])).SerializeToString()
    assert post_traces(live_platform, body, key=live_platform.tokens["alice"])[0] == 401
    with pytest.raises(grpc.RpcError) as failure:
        grpc_export_raw(live_platform.grpc_target, body, metadata=grpc_auth(live_platform.tokens["alice"]))
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    live_platform.process.wait_idle()
    assert requests_of(live_platform, span.trace_id.hex(), live_platform.tokens["alice"]) == []


def test_create_api_token_rejects_unknown_roles_and_projects(live_platform):
    for args in (("--role", "superuser"), ("--role", "Admin"), ("--project", "no-such-project")):
        with pytest.raises(subprocess.CalledProcessError) as failure:
            live_platform.process.manage("create_api_token", "--user", "mallory", *args)
        assert failure.value.stdout.strip() == ""  # no token printed
        assert "invalid choice" in failure.value.stderr or "no project" in failure.value.stderr


# -- management commands and storage (ORM, no platform process) ---------------------------------------------


def run(command: str, *args) -> str:
    out = io.StringIO()
    call_command(command, *args, stdout=out)
    return out.getvalue().strip()


def all_stored_text() -> str:
    """Every value of every row of every table, as text: a secret must not appear anywhere."""
    from django.db import connection

    chunks = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT * FROM {connection.ops.quote_name(table)}')
            chunks.extend(repr(row) for row in cursor.fetchall())
    return "\n".join(chunks)


@pytest.fixture
def key_cache():
    from tenancy.keys import forget_cached_keys

    forget_cached_keys()
    yield
    forget_cached_keys()


def test_ingest_keys_are_stored_hashed(db, key_cache):
    from tenancy.keys import resolve_ingest_key
    from tenancy.models import IngestKey, Project

    raw = run("create_ingest_key", "--project", "alpha", "--name", "ci")
    second = run("create_ingest_key", "--project", "alpha")
    assert raw.startswith("lok_") and len(raw) >= 40 and raw != second
    key = IngestKey.objects.get(name="ci")
    assert key.project == Project.objects.get(name="alpha")
    assert key.key_hash == hashlib.sha256(raw.encode()).hexdigest()
    assert key.key_hash != raw and key.display_prefix == raw[:12]
    stored = all_stored_text()
    assert raw not in stored and second not in stored
    assert raw[12:] not in stored  # not even the secret part
    identity = resolve_ingest_key(raw)
    assert identity is not None and identity.project_id == key.project_id
    assert resolve_ingest_key(key.key_hash) is None  # the hash itself is not a key


def test_api_tokens_are_stored_hashed(db):
    from tenancy.keys import resolve_api_token
    from tenancy.models import ApiToken

    run("create_ingest_key", "--project", "alpha")
    raw = run("create_api_token", "--user", "alice", "--project", "alpha")
    token = ApiToken.objects.get(user__username="alice")
    assert raw.startswith("lot_")
    assert token.token_hash == hashlib.sha256(raw.encode()).hexdigest() and token.display_prefix == raw[:12]
    assert raw not in all_stored_text()
    assert resolve_api_token(raw).username == "alice"
    assert resolve_api_token(token.token_hash) is None


@pytest.mark.parametrize("name", ["Alpha Team", "../etc", "", "a/b", "émile"])
def test_create_ingest_key_wants_a_slug(db, name):
    from tenancy.models import IngestKey, Project

    with pytest.raises(CommandError):
        run("create_ingest_key", "--project", name)
    assert not Project.objects.exists() and not IngestKey.objects.exists()


def test_create_api_token_roles_and_projects(db):
    from django.contrib.auth import get_user_model
    from tenancy.keys import resolve_api_token
    from tenancy.models import ApiToken, Membership

    for project in ("alpha", "beta", "gamma"):
        run("create_ingest_key", "--project", project)

    def memberships(user):
        return {m.project.name: m.role for m in Membership.objects.filter(user__username=user).select_related("project")}

    viewer = run("create_api_token", "--user", "vera", "--project", "alpha")
    assert memberships("vera") == {"alpha": "viewer"}  # viewer is the default role
    assert ApiToken.objects.get(user__username="vera").role == "viewer"
    identity = resolve_api_token(viewer)
    assert set(identity.project_names) == {"alpha"} and identity.role_in(identity.project_names["alpha"]) == "viewer"

    run("create_api_token", "--user", "otto", "--role", "operator", "--project", "alpha", "--project", "beta")
    assert memberships("otto") == {"alpha": "operator", "beta": "operator"}

    # no --project for a new user: every existing project; for a user with memberships: unchanged
    run("create_api_token", "--user", "ada", "--role", "admin")
    assert memberships("ada") == {"alpha": "admin", "beta": "admin", "gamma": "admin"}
    run("create_api_token", "--user", "vera", "--role", "operator")
    assert memberships("vera") == {"alpha": "viewer"}
    assert sorted(ApiToken.objects.filter(user__username="vera").values_list("role", flat=True)) == \
        ["operator", "viewer"]

    with pytest.raises(CommandError, match="invalid choice"):
        run("create_api_token", "--user", "vera", "--role", "root")
    with pytest.raises(CommandError, match="no project"):
        run("create_api_token", "--user", "vera", "--project", "delta")
    assert ApiToken.objects.filter(user__username="vera").count() == 2
    # a typo in a project name leaves nothing behind: no user, no membership in the projects before it
    with pytest.raises(CommandError, match="no project"):
        run("create_api_token", "--user", "zed", "--project", "alpha", "--project", "alhpa")
    assert not get_user_model().objects.filter(username="zed").exists()
    assert not Membership.objects.filter(user__username="zed").exists()


def test_token_role_caps_the_membership_role(db):
    from tenancy.keys import resolve_api_token

    run("create_ingest_key", "--project", "alpha")
    admin_token = run("create_api_token", "--user", "ada", "--role", "admin", "--project", "alpha")
    viewer_token = run("create_api_token", "--user", "ada", "--role", "viewer")  # keeps the admin membership
    project_id = resolve_api_token(admin_token).project_names["alpha"]
    assert resolve_api_token(admin_token).role_in(project_id) == "admin"
    capped = resolve_api_token(viewer_token)
    assert capped.role_in(project_id) == "viewer"
    assert capped.can(project_id, "viewer") and not capped.can(project_id, "operator")


def test_revoked_token_and_inactive_user_are_refused(db):
    from django.contrib.auth import get_user_model
    from tenancy.keys import resolve_api_token
    from tenancy.models import ApiToken

    run("create_ingest_key", "--project", "alpha")
    first = run("create_api_token", "--user", "ivan", "--project", "alpha")
    second = run("create_api_token", "--user", "ivan")
    ApiToken.objects.get(token_hash=hashlib.sha256(first.encode()).hexdigest()).revoke()
    assert resolve_api_token(first) is None
    assert resolve_api_token(second) is not None
    get_user_model().objects.filter(username="ivan").update(is_active=False)
    assert resolve_api_token(second) is None


def test_revoke_ingest_key_by_prefix_or_full_key(db, key_cache, settings):
    from tenancy.keys import resolve_ingest_key
    from tenancy.models import IngestKey

    settings.INGEST = {**settings.INGEST, "KEY_CACHE_SECONDS": 0}
    first = run("create_ingest_key", "--project", "alpha")
    second = run("create_ingest_key", "--project", "alpha")
    assert resolve_ingest_key(first) and resolve_ingest_key(second)

    out = run("revoke_ingest_key", first[:12])
    assert "revoked" in out and first[:12] in out and first not in out
    assert resolve_ingest_key(first) is None
    assert resolve_ingest_key(second) is not None

    run("revoke_ingest_key", second)
    assert resolve_ingest_key(second) is None
    assert IngestKey.objects.filter(revoked_at__isnull=True).count() == 0
    assert "already revoked" in run("revoke_ingest_key", second[:12])

    with pytest.raises(CommandError, match="no ingest key"):
        run("revoke_ingest_key", "lok_nosuchkey")
    with pytest.raises(CommandError):
        run("revoke_ingest_key", "  ")


def test_revoke_ingest_key_refuses_an_ambiguous_prefix(db, key_cache, settings):
    from tenancy.keys import resolve_ingest_key
    from tenancy.models import IngestKey, Project, hash_secret

    settings.INGEST = {**settings.INGEST, "KEY_CACHE_SECONDS": 0}
    project = Project.objects.create(name="alpha")
    raws = ["lok_SAMEPREFone", "lok_SAMEPREFtwo"]
    for raw in raws:
        IngestKey.objects.create(project=project, display_prefix=raw[:12], key_hash=hash_secret(raw))
    with pytest.raises(CommandError, match="pass the full key"):
        run("revoke_ingest_key", "lok_SAMEPREF")
    assert all(resolve_ingest_key(raw) for raw in raws)
    run("revoke_ingest_key", raws[0])
    assert resolve_ingest_key(raws[0]) is None and resolve_ingest_key(raws[1]) is not None


def test_revoked_key_stays_valid_until_the_cache_expires(db, key_cache, settings):
    """Revocation takes effect within INGEST_KEY_CACHE_SECONDS (documented); with the cache off, at once."""
    from tenancy.keys import forget_cached_keys, resolve_ingest_key

    settings.INGEST = {**settings.INGEST, "KEY_CACHE_SECONDS": 3600}
    raw = run("create_ingest_key", "--project", "alpha")
    assert resolve_ingest_key(raw) is not None
    run("revoke_ingest_key", raw)
    assert resolve_ingest_key(raw) is not None  # still cached in this process
    forget_cached_keys()
    assert resolve_ingest_key(raw) is None
