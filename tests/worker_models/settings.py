"""The demo project's settings, with these URLs, the Celery app's broker, and the test
databases: ``DJLOCKS_TEST_DATABASES`` (JSON, alias -> name) as the test run made them."""

import json
import os

from project.settings import *  # noqa: F403
from project.settings import DATABASES

for alias, name in json.loads(os.environ.get("DJLOCKS_TEST_DATABASES", "{}")).items():
    DATABASES[alias]["NAME"] = name

ROOT_URLCONF = "tests.worker_models.urls"
CELERY_BROKER_URL = CELERY_RESULT_BACKEND = os.environ.get("DJLOCKS_CELERY_BROKER", "")
