"""Body-size limits and bounded decompression: a gzip bomb is refused after at most `limit` bytes of output."""
from __future__ import annotations

import zlib


class PayloadTooLarge(Exception):
    pass


class MalformedPayload(Exception):
    pass


class UnsupportedEncoding(Exception):
    pass


_CHUNK = 256 * 1024


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo Content-Encoding (gzip, deflate or none) without ever holding more than `limit` bytes of output."""
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        if len(body) > limit:
            raise PayloadTooLarge(f"body is {len(body)} bytes; the limit is {limit}")
        return body
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise UnsupportedEncoding(f"unsupported Content-Encoding {encoding!r} (use gzip)")
    out = bytearray()
    data = body
    try:
        # A gzip body may hold several members one after another (as `gzip.decompress` reads it);
        # the limit applies to their sum.
        while True:
            inflater = zlib.decompressobj(wbits)
            while data:
                # max_length bounds each step, so a bomb never expands past limit + one chunk.
                out += inflater.decompress(data, _CHUNK)
                if len(out) > limit:
                    raise PayloadTooLarge(f"decompressed body exceeds the limit of {limit} bytes")
                data = inflater.unconsumed_tail
                if inflater.eof:
                    break
            if not inflater.eof:
                out += inflater.flush()
                if not inflater.eof:
                    raise MalformedPayload(f"truncated {encoding} stream")
            data = inflater.unused_data
            if not data:
                break
            if encoding != "gzip" or data[:2] != b"\x1f\x8b":
                raise MalformedPayload(f"unexpected data after the end of the {encoding} stream")
    except zlib.error as exc:
        raise MalformedPayload(f"invalid {encoding} stream: {exc}") from exc
    if len(out) > limit:
        raise PayloadTooLarge(f"decompressed body exceeds the limit of {limit} bytes")
    return bytes(out)
