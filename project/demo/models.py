from django.db import models


class FencedCounter(models.Model):
    """A resource protected by fencing: for the demo, and for the tests' check that only
    the newest holder's writes land."""

    name = models.CharField(max_length=100, unique=True)
    value = models.IntegerField(default=0)
    fence = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name} = {self.value} (fence {self.fence})"
