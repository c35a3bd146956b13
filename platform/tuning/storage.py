"""Optuna's RDB storage in the platform's database (SQLite in embedded mode, PostgreSQL in server mode): one
engine per process, and each study's Optuna study ``tuning-<id>`` in it."""
from __future__ import annotations

import threading
from typing import Any
from urllib.parse import quote

import optuna
from django.conf import settings

from . import search as S
from .models import TuningStudy

_storages: dict[str, Any] = {}
_storage_lock = threading.Lock()


def storage_url() -> str:
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    user = quote(db.get("USER") or "", safe="")
    password = quote(db.get("PASSWORD") or "", safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = db.get("HOST") or "localhost"
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"postgresql+psycopg://{auth}{host}{port}/{quote(db['NAME'], safe='')}"


def storage() -> optuna.storages.RDBStorage:
    """Optuna's RDB storage in the platform's database (one engine per process)."""
    url = storage_url()
    with _storage_lock:
        if url not in _storages:
            kwargs = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
            _storages[url] = optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        return _storages[url]


def optuna_study(study: TuningStudy, *, create: bool = False) -> optuna.Study:
    """The study's Optuna study (created, with its directions and sampler, when ``create``; KeyError when it is
    not there)."""
    if create:
        return optuna.create_study(study_name=study.optuna_name, storage=storage(),
                                   directions=S.directions(study.objective),
                                   sampler=S.sampler(study.objective, study.seed), load_if_exists=True)
    return optuna.load_study(study_name=study.optuna_name, storage=storage(),
                             sampler=S.sampler(study.objective, study.seed))
