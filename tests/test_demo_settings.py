"""The demo project is safe to start on a laptop: without DJANGO_DEBUG,
DJANGO_SECRET_KEY and REDIS_URL it runs with DEBUG off, a random secret key of
its own checkout, no Redis, and pages that cannot be framed; ``check --deploy``
lists only what a loopback demo cannot have (HTTPS and what rests on it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from djlocks import db_lock

BASE_DIR = Path(settings.BASE_DIR)
#: What a demo on 127.0.0.1 without HTTPS cannot have: HSTS, the redirect to HTTPS,
#: and cookies sent over HTTPS only.
LOOPBACK_ONLY = {"security.W004", "security.W008", "security.W012", "security.W016"}
UNSAFE_DEFAULTS = ("REDIS_URL", "DJANGO_DEBUG", "DJANGO_SECRET_KEY", "DJANGO_SETTINGS_MODULE")


def bare_environment(var_dir: Path) -> dict[str, str]:
    """This environment without the settings' switches, on SQLite in ``var_dir``."""
    environment = {k: v for k, v in os.environ.items() if k not in UNSAFE_DEFAULTS}
    return {**environment, "DJLOCKS_DB": "sqlite", "DJLOCKS_VAR_DIR": str(var_dir)}


def settings_seen(var_dir: Path) -> dict[str, object]:
    """What project.settings sets when imported in a fresh process."""
    program = (
        "import json, project.settings as s; print(json.dumps({'debug': s.DEBUG, "
        "'secret_key': s.SECRET_KEY, 'caches': sorted(s.CACHES), "
        "'backends': sorted(s.DJLOCKS['BACKENDS']), 'middleware': s.MIDDLEWARE}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", program],
        cwd=BASE_DIR,
        env=bare_environment(var_dir),
        capture_output=True,
        text=True,
        check=True,
    )
    seen: dict[str, object] = json.loads(out.stdout)
    return seen


def test_the_demo_settings_are_safe_without_any_environment(tmp_path: Path) -> None:
    first = settings_seen(tmp_path)
    assert first["debug"] is False
    key = str(first["secret_key"])
    assert key != "djlocks-demo-not-secret" and len(key) >= 50
    assert (tmp_path / "secret_key").read_text().strip() == key
    assert (tmp_path / "secret_key").stat().st_mode & 0o077 == 0, "readable by others"
    assert settings_seen(tmp_path)["secret_key"] == key, "one key per checkout"
    assert settings_seen(tmp_path / "other")["secret_key"] != key
    assert "redis" not in first["caches"] and "redis" not in first["backends"]
    assert "django.middleware.clickjacking.XFrameOptionsMiddleware" in str(first["middleware"])


def test_check_deploy_lists_only_what_a_loopback_demo_cannot_have(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy"],
        cwd=BASE_DIR,
        env=bare_environment(tmp_path),
        capture_output=True,
        text=True,
    )
    found = set(re.findall(r"^\S+: \((\w+\.[EWI]\d+)\)", out.stdout + out.stderr, re.M))
    assert found == LOOPBACK_ONLY, out.stdout + out.stderr


@pytest.mark.usefixtures("store")
def test_the_release_page_cannot_be_framed(admin_client: Client) -> None:
    with db_lock("demo:framed", timeout=0) as grant:
        query = f"?backend=default&name=demo:framed&fence={grant.fence}"
        page = admin_client.get(reverse("admin:djlocks_release") + query)
        assert page.status_code == 200
        assert page["X-Frame-Options"] in ("DENY", "SAMEORIGIN")


@pytest.mark.django_db
def test_the_demo_superuser_gets_a_new_random_password_each_time() -> None:
    passwords = []
    for _ in range(2):
        out = StringIO()
        call_command("demo_superuser", stdout=out)
        (password,) = re.findall(r"password (\S+)\)", out.getvalue())
        passwords.append(password)
    demo = User.objects.get(username="demo")
    assert demo.is_superuser and demo.is_staff
    assert demo.check_password(passwords[1]) and not demo.check_password(passwords[0])
    assert "demo" not in passwords and len(set(passwords)) == 2
