"""The GET_LOCK backend's fence sequence and restart marker (MariaDB only).

MariaDB has sequences (10.3 and later); MySQL has none and keeps issuing the
GET_LOCK backend's fences from the session fence table. The sequence starts
above every fence that table has issued and above the server's clock in
microseconds, so no name's fences go back. Processes of an earlier djlocks that
issue fences from that table must be stopped before this migration runs (see the
changelog).
"""

from django.db import migrations

SEQUENCE = "djlocks_session_fence_seq"
MARKER = "djlocks_session_fence_guard"
CLOCK = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))"


def is_mariadb(schema_editor):
    connection = schema_editor.connection
    return connection.vendor == "mysql" and connection.mysql_is_mariadb


def create(apps, schema_editor):
    if not is_mariadb(schema_editor):
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"SELECT GREATEST(COALESCE(MAX(fence), 0) + 1, {CLOCK}) FROM djlocks_session_fence")
        start = int(cursor.fetchone()[0])
    schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} START WITH {start}")
    schema_editor.execute(f"CREATE TABLE IF NOT EXISTS {MARKER} (marked BOOL PRIMARY KEY) ENGINE=MEMORY")


def drop(apps, schema_editor):
    if not is_mariadb(schema_editor):
        return
    schema_editor.execute(f"DROP TABLE IF EXISTS {MARKER}")
    schema_editor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")


class Migration(migrations.Migration):
    atomic = False  # MariaDB cannot roll DDL back, so Django refuses it in a transaction
    dependencies = [("djlocks", "0008_fence_used_at")]

    operations = [migrations.RunPython(create, drop)]
