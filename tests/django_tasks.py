"""A task of Django's own tasks framework (Django 6.0+), limited by djlocks: tasks must
be defined at a module's top level."""

from django.tasks import task

from djlocks.backends import backends
from djlocks.tasks import limit_concurrency

#: What each run saw: (user_id, whether its slot was held while it ran).
seen: list[tuple[int, bool]] = []


@task
@limit_concurrency("t-django:{user_id}", when_busy="skip")
def greet(user_id: int) -> int:
    seen.append((user_id, bool(backends["default"].holders(f"t-django:{user_id}"))))
    return user_id
