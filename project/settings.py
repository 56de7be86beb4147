"""Settings of the demo and test project.

``DJLOCKS_DB`` picks the database: ``sqlite`` (default, a file), ``postgresql``
or ``mysql``; the loopback servers are the defaults and ``DJLOCKS_DB_HOST``,
``DJLOCKS_DB_PORT``, ``DJLOCKS_DB_USER``, ``DJLOCKS_DB_PASSWORD``,
``DJLOCKS_DB_NAME`` override them. ``DJLOCKS_SQLITE_PATH`` moves the SQLite file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DJLOCKS_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "djlocks-demo-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
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

# The Redis that the `redis` lock backend uses, through django-redis.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "redis": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": REDIS_URL},
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
        # Leases in Redis, on the django-redis cache above.
        "redis": {
            "BACKEND": "djlocks.backends.redis.RedisBackend",
            "OPTIONS": {"cache": "redis"},
        },
    },
    "TTL": 60,
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
