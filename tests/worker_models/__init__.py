"""The demo project served by real workers (gunicorn's sync, gthread and gevent,
uvicorn, a Celery prefork worker) for ``tests/test_worker_models.py``: each holds
a lock with a short TTL while it works, and says whether its lease was renewed
and whether it was lost."""
