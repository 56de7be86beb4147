"""The advisory-lock backend's fence sequence and crash marker (PostgreSQL only).

The sequence starts above every fence the session fence table has issued, so no
name's fences go back. Processes of an earlier djlocks that issue fences from that
table must be stopped before this migration runs (see the changelog).
"""

from django.db import migrations

SEQUENCE = "djlocks_session_fence_seq"
MARKER = "djlocks_session_fence_guard"


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}")
    schema_editor.execute(
        f"SELECT setval('{SEQUENCE}', "
        f"(SELECT COALESCE(max(fence), 0) + 1 FROM djlocks_session_fence), false)"
    )
    schema_editor.execute(f"CREATE UNLOGGED TABLE IF NOT EXISTS {MARKER} (marked boolean PRIMARY KEY)")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP TABLE IF EXISTS {MARKER}")
    schema_editor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")


class Migration(migrations.Migration):
    dependencies = [("djlocks", "0005_graceful_release")]

    operations = [migrations.RunPython(create, drop)]
