"""kombu's filesystem transport (the embedded-mode Celery broker) with message files that appear whole.

kombu writes a message by creating `<n>_<uuid>.<queue>.msg` and then writing into it, while a consumer
lists the folder, moves each matching file away and reads it: a consumer that wins the race reads an
empty file, fails to decode it, and the worker's consumer loop dies with it. Here the message is
written under a name no consumer matches and renamed into place (atomic on POSIX), and a message that
cannot be decoded anyway is dropped with a warning instead of stopping the worker. The exchange tables
(which queue a routing key reaches) get the same treatment: kombu creates the table file, then locks and
fills it, so a publisher that read it in between found no binding and its message went nowhere; here
the table is rewritten under an exclusive lock file and renamed into place, so readers always see a
whole table, and this process's own bindings count before they reach the file. Celery uses this transport when CELERY_BROKER_URL is filesystem:// (observatory/celery_app.py).
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import uuid
from queue import Empty
from time import monotonic, sleep

from celery.worker import state
from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps, loads

log = logging.getLogger(__name__)


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.partial")  # ".<…>" never matches a queue
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _queue_bind(self, exchange, routing_key, pattern, queue):
        self.control_folder.mkdir(parents=True, exist_ok=True)
        table_file = self._exchange_file(exchange)
        entry = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        lock_path = os.path.join(str(self.control_folder), f".{exchange}.lock")
        try:
            with open(lock_path, "a+b") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
                table = self._read_table(table_file)
                if entry in table:
                    return
                table.insert(0, entry)
                partial = f"{table_file}.{uuid.uuid4().hex}.partial"
                with open(partial, "wb") as f:
                    f.write(str_to_bytes(dumps(table)))
                os.replace(partial, table_file)
        except OSError as exc:
            raise ChannelError(f"Cannot bind queue {queue!r} to exchange {exchange!r}") from exc

    def get_table(self, exchange):
        try:
            table = self._read_table(self._exchange_file(exchange))
        except OSError as exc:
            raise ChannelError(f"Cannot read the table of exchange {exchange!r}") from exc
        # kombu records a binding in the transport's in-process state *before* writing the file, and
        # another thread seeing it there skips its own bind: bindings of this process count even when
        # the file does not have them yet (else that thread's first messages are routed nowhere).
        state = self.state.exchanges.get(exchange) or {}
        for meta in state.get("table") or ():
            entry = filesystem.exchange_queue_t(*meta)
            if entry not in table:
                table.append(entry)
        return table

    @staticmethod
    def _read_table(path) -> list:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        return [filesystem.exchange_queue_t(*row) for row in loads(data)] if data else []

    def _get(self, queue):
        while True:
            try:
                return super()._get(queue)
            except ValueError:  # the file was already moved away: the next one is tried
                log.warning("dropped an undecodable message file of queue %s", queue)


class Transport(filesystem.Transport):
    Channel = Channel
    # kombu looks in the folder once a second: a fifth of that takes a task in ~0.1 s rather than ~0.5 s on
    # average, for a few directory listings a second.
    polling_interval = 0.2

    def drain_events(self, connection, timeout=None):
        """kombu's loop, which waits out its whole timeout (the worker asks for 2 s) however soon the worker was
        told to stop; this one returns at its next look once it is (a platform's shutdown spent 2 of its 3 s
        here)."""
        started = monotonic()
        interval = min(self.polling_interval, timeout) if timeout else self.polling_interval
        while True:
            try:
                self.cycle.get(self._deliver, timeout=timeout)
                return
            except Empty:
                if (timeout is not None and monotonic() - started >= timeout) or _worker_told_to_stop():
                    raise socket.timeout() from None
                sleep(interval)


def _worker_told_to_stop() -> bool:
    # As celery's own check: 0 (an exit code) asks too, so not a truthiness test.
    return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))
