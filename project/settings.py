"""Settings of the demo and test project.

``DJLOCKS_DB`` picks the database: ``sqlite`` (default, a file), ``postgresql``
or ``mysql``; the loopback servers are the defaults and ``DJLOCKS_DB_HOST``,
``DJLOCKS_DB_PORT``, ``DJLOCKS_DB_USER``, ``DJLOCKS_DB_PASSWORD``,
``DJLOCKS_DB_NAME`` override them. ``DJLOCKS_SQLITE_PATH`` moves the SQLite file.

Safe by default on a laptop: ``DEBUG`` only with ``DJANGO_DEBUG=1``; the secret
key is ``DJANGO_SECRET_KEY``, else a random one made once per checkout in
``var/secret_key``; Redis (the ``redis`` cache and lock backend) only with
``REDIS_URL`` set (``make test`` sets it). ``DJLOCKS_VAR_DIR`` moves ``var/``.
"""

from __future__ import annotations

import os
import secrets
from importlib.util import find_spec
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DJLOCKS_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def _secret_key(path: Path) -> str:
    """The secret key kept in ``path`` (made there, readable by its owner only, by the
    first process that needs it; a process that loses the race reads the winner's)."""
    if not path.exists():
        draft = path.with_name(f".{path.name}.{os.getpid()}")
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_urlsafe(50) + "\n")
        try:
            os.link(draft, path)  # atomic, and never replaces a key already made
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_text().strip()


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or _secret_key(VAR_DIR / "secret_key")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "djlocks",
    "project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
WSGI_APPLICATION = "project.wsgi.application"
STATIC_URL = "static/"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DB_VENDOR = os.environ.get("DJLOCKS_DB", "sqlite")


def _server(engine: str, port: int, user: str) -> dict[str, Any]:
    return {
        "ENGINE": engine,
        "HOST": os.environ.get("DJLOCKS_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("DJLOCKS_DB_PORT", str(port)),
        "USER": os.environ.get("DJLOCKS_DB_USER", user),
        "PASSWORD": os.environ.get("DJLOCKS_DB_PASSWORD", ""),
        "NAME": os.environ.get("DJLOCKS_DB_NAME", "test"),
    }


if DB_VENDOR == "sqlite":
    sqlite_path = Path(os.environ.get("DJLOCKS_SQLITE_PATH", VAR_DIR / "djlocks.sqlite3"))
    database: dict[str, Any] = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": sqlite_path,
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
        # A file, never the in-memory default: worker processes must see it.
        "TEST": {"NAME": str(sqlite_path.with_name("test_" + sqlite_path.name))},
    }
elif DB_VENDOR == "postgresql":
    database = _server("django.db.backends.postgresql", 5432, "postgres")
elif DB_VENDOR == "mysql":
    database = _server("django.db.backends.mysql", 3306, "root")
    database["OPTIONS"] = {"charset": "utf8mb4"}
else:
    raise RuntimeError(f"DJLOCKS_DB must be sqlite, postgresql or mysql, not {DB_VENDOR!r}.")

DATABASES = {"default": database}

# The Redis that the `redis` lock backend uses, through django-redis: none unless set.
REDIS_URL = os.environ.get("REDIS_URL", "")
CACHES: dict[str, dict[str, Any]] = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}

DJLOCKS: dict[str, Any] = {
    "BACKENDS": {
        "default": {
            "BACKEND": "djlocks.backends.lease.LeaseBackend",
            "OPTIONS": {"using": "default"},
        },
        # SELECT ... FOR UPDATE in the caller's transaction (on SQLite: the write lock).
        "row": {
            "BACKEND": "djlocks.backends.row.RowLockBackend",
            "OPTIONS": {"using": "default"},
        },
    },
    "TTL": 60,
}
if REDIS_URL:
    # Leases in Redis, on a django-redis cache.
    CACHES["redis"] = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": REDIS_URL}
    DJLOCKS["BACKENDS"]["redis"] = {
        "BACKEND": "djlocks.backends.redis.RedisBackend",
        "OPTIONS": {"cache": "redis"},
    }
# A Redis Cluster, by the URL of one of its nodes (the tests start one: tests/redis_cluster.py).
REDIS_CLUSTER_URL = os.environ.get("DJLOCKS_REDIS_CLUSTER", "")
if REDIS_CLUSTER_URL:
    DJLOCKS["BACKENDS"]["redis-cluster"] = {
        "BACKEND": "djlocks.backends.redis.RedisBackend",
        "OPTIONS": {"cluster": REDIS_CLUSTER_URL},
    }
if DB_VENDOR == "sqlite":
    # The row alias on SQLite is deliberate here: the tests of its write-lock form.
    SILENCED_SYSTEM_CHECKS = ["djlocks.W002"]
SESSION_BACKENDS = {
    "mysql": "djlocks.backends.mysql.GetLockBackend",
    "postgresql": "djlocks.backends.postgresql.AdvisoryLockBackend",
}
if DB_VENDOR in SESSION_BACKENDS:
    # Locks held by the database server's session: GET_LOCK or advisory locks.
    DJLOCKS["BACKENDS"]["session"] = {
        "BACKEND": SESSION_BACKENDS[DB_VENDOR],
        "OPTIONS": {"using": "default"},
    }

if find_spec("django.tasks") and find_spec("django_tasks_db"):
    # Django's tasks framework (Django 6+): "default" runs a task as it is enqueued;
    # "queue" is a real queue in the database (django-tasks-db, which make test-newest
    # installs), which `manage.py db_worker --backend queue` works through.
    INSTALLED_APPS.append("django_tasks_db")
    TASKS = {
        "default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"},
        "queue": {"BACKEND": "django_tasks_db.DatabaseBackend"},
    }
