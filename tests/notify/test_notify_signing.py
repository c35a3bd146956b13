"""Standard Webhooks signatures: the specification's published test vector, rotation (several signatures), and every
way a verification must fail."""
from __future__ import annotations

import base64

import pytest
from notify import signing
from notify.signing import WebhookVerificationError, verify

# The test vector published with the Standard Webhooks specification (and used by the svix libraries' tests).
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MSG_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
TIMESTAMP = 1614265330
BODY = b'{"test": 2432232314}'
SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
OTHER_SECRET = "whsec_" + base64.b64encode(b"another secret of 32 bytes......").decode()


def headers(signature=SIGNATURE, timestamp=TIMESTAMP, msg_id=MSG_ID) -> dict:
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp), "webhook-signature": signature}


def test_signing_reproduces_the_published_vector():
    assert signing.sign(MSG_ID, TIMESTAMP, BODY, [SECRET]) == SIGNATURE
    assert signing.signature_headers(MSG_ID, BODY, [SECRET], timestamp=TIMESTAMP) == headers()


def test_the_published_vector_verifies():
    assert verify(BODY, headers(), SECRET, now=TIMESTAMP) is True
    assert verify(BODY.decode(), headers(), [SECRET], now=TIMESTAMP + 299) is True
    # header names are case-insensitive, as HTTP frameworks deliver them in either case
    assert verify(BODY, {k.title(): v for k, v in headers().items()}, SECRET, now=TIMESTAMP)


def test_several_signatures_one_valid():
    # During a rotation the sender signs with every secret: a receiver with either one verifies.
    both = signing.sign(MSG_ID, TIMESTAMP, BODY, [OTHER_SECRET, SECRET])
    assert both.split(" ")[1] == SIGNATURE and both.count("v1,") == 2
    assert verify(BODY, headers(both), SECRET, now=TIMESTAMP)
    assert verify(BODY, headers(both), OTHER_SECRET, now=TIMESTAMP)
    # unknown versions and garbage entries are skipped, not fatal
    assert verify(BODY, headers(f"v2,abc v1,bm90LWEtc2lnbmF0dXJl {SIGNATURE}"), SECRET, now=TIMESTAMP)
    # a receiver holding several secrets accepts a delivery signed by any of them
    assert verify(BODY, headers(), [OTHER_SECRET, SECRET], now=TIMESTAMP)


def test_tampered_body_is_refused():
    with pytest.raises(WebhookVerificationError, match="no signature matches"):
        verify(b'{"test": 2432232315}', headers(), SECRET, now=TIMESTAMP)


def test_changed_id_or_timestamp_is_refused():
    with pytest.raises(WebhookVerificationError, match="no signature matches"):
        verify(BODY, headers(msg_id="msg_other"), SECRET, now=TIMESTAMP)
    with pytest.raises(WebhookVerificationError, match="no signature matches"):
        verify(BODY, headers(timestamp=TIMESTAMP + 1), SECRET, now=TIMESTAMP)


def test_wrong_secret_is_refused():
    with pytest.raises(WebhookVerificationError, match="no signature matches"):
        verify(BODY, headers(), OTHER_SECRET, now=TIMESTAMP)


def test_old_and_future_timestamps_are_refused():
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify(BODY, headers(), SECRET, now=TIMESTAMP + 301)
    with pytest.raises(WebhookVerificationError, match="future"):
        verify(BODY, headers(), SECRET, now=TIMESTAMP - 301)
    with pytest.raises(WebhookVerificationError, match="not an integer"):
        verify(BODY, headers(timestamp="yesterday"), SECRET, now=TIMESTAMP)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_headers_are_refused(missing):
    partial = {k: v for k, v in headers().items() if k != missing}
    with pytest.raises(WebhookVerificationError, match=f"missing header.*{missing}"):
        verify(BODY, partial, SECRET, now=TIMESTAMP)


def test_signature_without_a_version_prefix_is_refused():
    with pytest.raises(WebhookVerificationError):
        verify(BODY, headers(SIGNATURE.split(",", 1)[1]), SECRET, now=TIMESTAMP)


def test_generated_secrets_are_valid_and_distinct():
    first, second = signing.generate_secret(), signing.generate_secret()
    assert first != second and first.startswith("whsec_")
    assert len(signing.secret_key(first)) == 32
    assert signing.validate_secret(first) == first


@pytest.mark.parametrize("bad", ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_not base64!", "whsec_c2hvcnQ=", 42])
def test_bad_secrets_are_rejected_with_a_reason(bad):
    with pytest.raises(ValueError, match="secret"):
        signing.validate_secret(bad)
