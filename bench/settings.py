"""The project's settings plus the peers that need a Django app (``make bench`` only)."""

from project.settings import *  # noqa: F403
from project.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "db_mutex"]
