"""``manage.py demo_superuser``: the demo's admin user, with a new random password."""

from __future__ import annotations

import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

USERNAME = "demo"
ADMIN_URL = "http://127.0.0.1:8000/admin/djlocks/lockname/"


class Command(BaseCommand):
    help = (
        "Create the superuser 'demo', or give it a new password: a random one, printed "
        "once (it is stored only as a hash)."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        user, _ = get_user_model().objects.get_or_create(username=USERNAME)
        password = secrets.token_urlsafe(12)
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        self.stdout.write(f"Admin: {ADMIN_URL}  (user {USERNAME}, password {password})")
