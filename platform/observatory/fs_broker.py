"""kombu's filesystem transport (the embedded-mode Celery broker) with message files that appear whole.

kombu writes a message by creating `<n>_<uuid>.<queue>.msg` and then writing into it, while a consumer
lists the folder, moves each matching file away and reads it: a consumer that wins the race reads an
empty file, fails to decode it, and the worker's consumer loop dies with it. Here the message is
written under a name no consumer matches and renamed into place (atomic on POSIX), and a message that
cannot be decoded anyway is dropped with a warning instead of stopping the worker. Celery uses this
transport when CELERY_BROKER_URL is filesystem:// (observatory/celery_app.py).
"""
from __future__ import annotations

import logging
import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

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

    def _get(self, queue):
        while True:
            try:
                return super()._get(queue)
            except ValueError:  # the file was already moved away: the next one is tried
                log.warning("dropped an undecodable message file of queue %s", queue)


class Transport(filesystem.Transport):
    Channel = Channel
