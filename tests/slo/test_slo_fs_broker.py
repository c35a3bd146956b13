"""The embedded-mode broker (observatory/fs_broker.py): kombu's filesystem transport with message files that appear
whole. With kombu's own, a consumer could read a file before its producer wrote it and the worker died."""
from __future__ import annotations

import os
import threading
import time

from kombu import Connection, Exchange, Queue

TRANSPORT = "observatory.fs_broker:Transport"


def connection(folder: str) -> Connection:
    options = {"data_folder_in": folder, "data_folder_out": folder, "store_processed": False,
               "control_folder": os.path.join(folder, "control")}
    return Connection("filesystem://", transport=TRANSPORT, transport_options=options)


def test_concurrent_producers_and_a_consumer_lose_nothing_and_never_crash(tmp_path):
    folder = str(tmp_path)
    queue = Queue("race", Exchange("race", type="direct"), routing_key="race")
    got, errors = [], []
    produced = threading.Event()

    def produce():
        with connection(folder) as conn:
            producer = conn.Producer()
            for i in range(500):
                producer.publish({"i": i}, exchange=queue.exchange, routing_key="race", declare=[queue])

    def consume():
        with connection(folder) as conn:
            def on_message(body, message):
                got.append(body["i"])
                message.ack()

            with conn.Consumer(queue, callbacks=[on_message]):
                # Until every message arrived, or 20 s without one after the producers finished
                # (a quiet poll alone is no proof that the queue is empty).
                quiet_since = None
                while len(got) < 3 * 500:
                    try:
                        conn.drain_events(timeout=1)
                        quiet_since = None
                    except TimeoutError:
                        if produced.is_set():
                            quiet_since = quiet_since or time.monotonic()
                            if time.monotonic() - quiet_since > 20:
                                return
                    except Exception as exc:  # what killed the worker with kombu's own transport
                        errors.append(exc)
                        return

    consumer = threading.Thread(target=consume)
    consumer.start()
    producers = [threading.Thread(target=produce) for _ in range(3)]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join()
    produced.set()
    consumer.join(60)
    assert errors == []
    assert sorted(got) == sorted(list(range(500)) * 3)
    assert not [name for name in os.listdir(folder) if name.endswith((".msg", ".partial"))]


def test_an_undecodable_message_file_is_dropped_and_the_next_one_delivered(tmp_path, caplog):
    folder = str(tmp_path)
    queue = Queue("jobs", Exchange("jobs", type="direct"), routing_key="jobs")
    with connection(folder) as conn:
        conn.Producer().publish({"ok": 1}, exchange=queue.exchange, routing_key="jobs", declare=[queue])
        (tmp_path / "0_torn.jobs.msg").write_bytes(b"")  # sorts first: written by a foreign producer, torn
        message = conn.SimpleQueue(queue).get(timeout=5)
        assert message.payload == {"ok": 1}
    assert "dropped an undecodable message file of queue jobs" in caplog.text


def test_a_waiting_consumer_returns_soon_after_the_worker_is_told_to_stop(tmp_path, monkeypatch):
    """The worker's loop waits in drain_events (2 s at a time); kombu's own transport waits that out, this one
    returns at its next look once Celery's stop flag is set (0, an exit code, counts), so a platform stops in about
    a second rather than three. With no flag it waits its whole timeout, and delivers what arrives meanwhile."""
    from celery.worker import state

    folder = str(tmp_path)
    queue = Queue("jobs", Exchange("jobs", type="direct"), routing_key="jobs")
    got = []
    with connection(folder) as conn, conn.Consumer(queue, callbacks=[lambda body, message: got.append(body)]):
        started = time.monotonic()
        try:
            conn.drain_events(timeout=0.6)
        except TimeoutError:
            pass
        assert time.monotonic() - started >= 0.6 and got == []
        with connection(folder) as other:
            other.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="jobs", declare=[queue])
        conn.drain_events(timeout=30)
        assert got == [{"n": 1}]
        monkeypatch.setattr(state, "should_stop", None)
        threading.Timer(0.3, lambda: setattr(state, "should_stop", 0)).start()
        started = time.monotonic()
        try:
            conn.drain_events(timeout=30)
        except TimeoutError:
            pass
        assert time.monotonic() - started < 10, "drain_events waited out its timeout after the stop flag was set"
