"""For a Celery worker: ``celery -A tests.worker_models.tasks worker --pool prefork``."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.worker_models.settings")

app = Celery("djlocks_worker_models")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task
def hold_task(name: str, ttl: float, seconds: float, kind: str) -> dict[str, object]:
    """``holding.hold`` in a task: on a prefork worker, in a forked pool process."""
    from tests.worker_models.holding import hold

    return hold(name, ttl, seconds, kind)
