"""ingest.limits.decompress: bounded Content-Encoding handling (gzip bombs, truncated and garbage bodies)."""
from __future__ import annotations

import gzip
import os
import tracemalloc
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ingest.limits import MalformedPayload, PayloadTooLarge, UnsupportedEncoding, decompress

MB = 1024 * 1024
BOMB_BYTES = 1024 * MB  # 1 GiB of zeros once inflated


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """A gzip stream that inflates to 1 GiB of zeros, built chunk by chunk (never 1 GiB in memory here)."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = bytes(8 * MB)
    parts = [compressor.compress(chunk) for _ in range(BOMB_BYTES // len(chunk))]
    parts.append(compressor.flush())
    bomb = b"".join(parts)
    assert len(bomb) < 8 * MB  # the whole point: small on the wire
    return bomb


# -- round trips ---------------------------------------------------------------------------------
@given(st.binary(max_size=20_000))
@settings(max_examples=60, deadline=None)
def test_gzip_round_trip(data):
    assert decompress(gzip.compress(data), "gzip", limit=1 * MB) == data


@given(st.binary(max_size=20_000))
@settings(max_examples=30, deadline=None)
def test_deflate_round_trip(data):
    assert decompress(zlib.compress(data), "deflate", limit=1 * MB) == data


@pytest.mark.parametrize("encoding", ["gzip", "GZIP", " gzip ", "Gzip"])
def test_encoding_name_is_case_and_space_insensitive(encoding):
    payload = os.urandom(1000) + bytes(5000)
    assert decompress(gzip.compress(payload), encoding, limit=1 * MB) == payload


def test_large_gzip_body_under_the_limit_is_returned_whole():
    # Several inflate steps (more than one internal chunk) must concatenate correctly.
    payload = b"".join(os.urandom(64) * 512 for _ in range(40))  # ~1.3 MB, compressible
    assert decompress(gzip.compress(payload), "gzip", limit=2 * MB) == payload


def test_gzip_output_exactly_at_the_limit_is_accepted_and_one_byte_more_is_refused():
    payload = bytes(300_000)
    body = gzip.compress(payload)
    assert decompress(body, "gzip", limit=len(payload)) == payload
    with pytest.raises(PayloadTooLarge):
        decompress(body, "gzip", limit=len(payload) - 1)


@pytest.mark.parametrize("encoding", [None, "", "identity", "IDENTITY"])
def test_identity_passes_the_body_through(encoding):
    body = os.urandom(4096)
    assert decompress(body, encoding, limit=4096) == body


@pytest.mark.parametrize("encoding", [None, "", "identity"])
def test_identity_over_the_limit_is_refused(encoding):
    with pytest.raises(PayloadTooLarge):
        decompress(os.urandom(4097), encoding, limit=4096)


# -- bombs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [1 * MB, 16 * MB])
def test_gzip_bomb_is_refused_without_inflating_it(gzip_bomb, limit):
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge):
            decompress(gzip_bomb, "gzip", limit=limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Bounded by the limit plus the (already size-limited) compressed body, which is copied as input is
    # consumed; nowhere near the 1 GiB the bomb inflates to.
    bound = 3 * limit + 3 * len(gzip_bomb) + 4 * MB
    assert peak < bound, f"peak {peak / MB:.1f} MB while refusing a bomb with limit {limit / MB} MB"
    assert peak < BOMB_BYTES // 20


def test_deflate_bomb_is_refused():
    compressor = zlib.compressobj(1)
    chunk = bytes(4 * MB)
    body = b"".join(compressor.compress(chunk) for _ in range(64)) + compressor.flush()  # 256 MiB of zeros
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge):
            decompress(body, "deflate", limit=2 * MB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * MB


def test_bomb_split_over_many_gzip_members_is_still_bounded():
    """RFC 1952 allows concatenated members: the limit applies to the whole output, not per member."""
    member = gzip.compress(bytes(1 * MB))
    body = member * 40  # 40 MiB inflated
    with pytest.raises((PayloadTooLarge, MalformedPayload)):  # refusing multi-member bodies is fine too
        decompress(body, "gzip", limit=8 * MB)


# -- malformed bodies ------------------------------------------------------------------------------
def test_multi_member_gzip_is_not_silently_truncated():
    """`gzip -c a b`, or a client that flushes members, sends several members: decoding only the first
    would drop the spans of the others while still answering 200. Either decode them all (as
    gzip.decompress does) or refuse the body; never return just a prefix."""
    first, second = b"first member " * 100, b"second member " * 100
    body = gzip.compress(first) + gzip.compress(second)
    try:
        result = decompress(body, "gzip", limit=1 * MB)
    except MalformedPayload:
        return
    assert result == first + second


def test_trailing_garbage_after_gzip_stream_is_refused():
    """Bytes after the gzip trailer that are not another member mean the body is corrupt (gzip.decompress
    refuses it too); accepting it would silently ignore part of what the client sent."""
    body = gzip.compress(b"payload" * 100) + b"this is not gzip"
    with pytest.raises(MalformedPayload):
        decompress(body, "gzip", limit=1 * MB)


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_truncated_gzip_is_malformed(data):
    payload = data.draw(st.binary(min_size=1, max_size=5000)) + os.urandom(200)
    body = gzip.compress(payload)
    cut = data.draw(st.integers(min_value=1, max_value=len(body) - 1), label="cut")
    with pytest.raises(MalformedPayload):
        decompress(body[:cut], "gzip", limit=1 * MB)


def test_truncated_bomb_is_too_large_or_malformed_never_accepted(gzip_bomb):
    with pytest.raises((PayloadTooLarge, MalformedPayload)):
        decompress(gzip_bomb[: len(gzip_bomb) // 2], "gzip", limit=1 * MB)


@pytest.mark.parametrize(
    "body",
    [
        b"this is definitely not gzip",
        b"\x1f\x8b",  # magic only
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03",  # a header and nothing else
        b"\x1f\x8b\x08" + os.urandom(400),  # a header followed by noise
        bytes(100),
        os.urandom(2000),
    ],
    ids=["text", "magic-only", "header-only", "header-then-noise", "zeros", "random"],
)
def test_garbage_gzip_is_malformed(body):
    with pytest.raises(MalformedPayload):
        decompress(body, "gzip", limit=1 * MB)


@given(st.binary(min_size=1, max_size=2000))
@settings(max_examples=80, deadline=None)
def test_arbitrary_bytes_never_escape_as_another_exception(body):
    for encoding in ("gzip", "deflate"):
        try:
            out = decompress(body, encoding, limit=64 * 1024)
        except (MalformedPayload, PayloadTooLarge):
            continue
        assert len(out) <= 64 * 1024


def test_corrupted_crc_is_malformed():
    body = bytearray(gzip.compress(b"hello world" * 50))
    body[-8] ^= 0xFF  # CRC32 in the trailer
    with pytest.raises(MalformedPayload):
        decompress(bytes(body), "gzip", limit=1 * MB)


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "x-gzip-but-not-really", "gzip, br", "snappy"])
def test_unsupported_encoding(encoding):
    with pytest.raises(UnsupportedEncoding):
        decompress(b"whatever", encoding, limit=1 * MB)
