"""``make install-test``: djlocks as a new user gets it, from the wheel.

Builds the wheel and the sdist, checks that both carry every file of the
package, then for each variant (the base install on SQLite, and one per extra)
makes a fresh virtualenv, installs the wheel with only that extra, creates a
project with ``django-admin startproject``, adds djlocks to it, and runs:
``check``, ``migrate``, the project's own ``manage.py test`` (tests/host_project/),
a ``runlocked`` job and a conflicting second run (exit 75), ``djlocks list
--json``, and the admin dashboard in headless Chromium as a superuser, with the
held lock's holder on the page and the dashboard's stylesheet served.

Usage: ``python -m tests.installation [VARIANT ...]`` (default: every variant).
Any failure exits non-zero with the step's output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.faults import free_port, wait_for_http

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "var" / "install-test"
HOST_FILES = ROOT / "tests" / "host_project"
HELD = "install:nightly-import"
LABEL = "installation test holder"


@dataclass(frozen=True)
class Variant:
    extra: str | None
    settings: str  # appended to the new project's settings.py
    lock_backend: str = "default"  # the alias the runlocked job and the dashboard use
    absent: tuple[str, ...] = ()  # driver modules this install must not have


SQLITE = """
DATABASES["default"]["OPTIONS"] = {
    "transaction_mode": "IMMEDIATE",
    "timeout": 20,
    "init_command": "PRAGMA journal_mode=WAL;",
}
"""


def _server(engine: str, user: str, port: int, options: str = "{}") -> str:
    return f"""
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.{engine}", "NAME": "djlocks_install",
    "HOST": "127.0.0.1", "PORT": "{port}", "USER": "{user}", "OPTIONS": {options},
}}}}
"""


VARIANTS = {
    "base": Variant(
        None, SQLITE, absent=("redis", "django_redis", "MySQLdb", "psycopg", "prometheus_client")
    ),
    "postgresql": Variant(
        "postgresql",
        _server("postgresql", "postgres", 5432)
        + """DJLOCKS = {"BACKENDS": {
    "default": {"BACKEND": "djlocks.backends.lease.LeaseBackend"},
    "session": {"BACKEND": "djlocks.backends.postgresql.AdvisoryLockBackend"},
}}
""",
        lock_backend="session",
        absent=("redis", "MySQLdb", "prometheus_client"),
    ),
    "mysql": Variant(
        "mysql",
        _server("mysql", "root", 3306, '{"charset": "utf8mb4"}')
        + """DJLOCKS = {"BACKENDS": {
    "default": {"BACKEND": "djlocks.backends.lease.LeaseBackend"},
    "session": {"BACKEND": "djlocks.backends.mysql.GetLockBackend"},
}}
""",
        lock_backend="session",
        absent=("redis", "psycopg", "prometheus_client"),
    ),
    "redis": Variant(
        "redis,prometheus,otel",
        SQLITE
        + """CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "locks": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:6379/0"},
}
DJLOCKS = {
    "BACKENDS": {
        "default": {"BACKEND": "djlocks.backends.lease.LeaseBackend"},
        "redis": {"BACKEND": "djlocks.backends.redis.RedisBackend", "OPTIONS": {"cache": "locks"}},
    },
    "KEY_PREFIX": "djlocks-install",
}
""",
        lock_backend="redis",
        absent=("MySQLdb", "psycopg"),
    ),
}


def main(names: list[str]) -> int:
    unknown = set(names) - set(VARIANTS)
    if unknown:
        print(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
        return 2
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    wheel, sdist = build()
    check_archives(wheel, sdist)
    for name in names or list(VARIANTS):
        started = time.monotonic()
        print(f"\n=== {name}: the wheel with extra {VARIANTS[name].extra or '(none)'}")
        try_variant(name, VARIANTS[name], wheel)
        print(f"=== {name}: passed in {time.monotonic() - started:.0f} s")
    print(f"\ninstallation test: {len(names or VARIANTS)} variants passed")
    return 0


# -- the archives ----------------------------------------------------------------


def build() -> tuple[Path, Path]:
    dist = WORK / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], quiet=True)
    [wheel] = dist.glob("djlocks-*.whl")
    [sdist] = dist.glob("djlocks-*.tar.gz")
    return wheel, sdist


def check_archives(wheel: Path, sdist: Path) -> None:
    """Both archives carry every file git tracks under djlocks/; the sdist no tests."""
    tracked = set(run(["git", "ls-files", "djlocks"], cwd=ROOT, quiet=True).splitlines())
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    root = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as archive:
        in_sdist = {member.removeprefix(f"{root}/") for member in archive.getnames()}
    for archive, files in ((wheel.name, in_wheel), (sdist.name, in_sdist)):
        missing = sorted(tracked - files)
        assert not missing, f"{archive} lacks {missing}"
    metadata = f"{wheel.name.split('-py3')[0]}.dist-info"
    for needed in (f"{metadata}/licenses/LICENSE", f"{metadata}/entry_points.txt"):
        assert needed in in_wheel, f"{wheel.name} lacks {needed}"
    assert not any(name.startswith("tests/") for name in in_sdist), "the sdist ships tests"
    print(f"{wheel.name}: {len(in_wheel)} files; {sdist.name}: {len(in_sdist)} files")


# -- one variant ---------------------------------------------------------------


def try_variant(name: str, variant: Variant, wheel: Path) -> None:
    home = WORK / name
    venv = home / "venv"
    python = str(venv / "bin" / "python")
    run([sys.executable, "-m", "venv", str(venv)])
    requirement = f"{wheel}[{variant.extra}]" if variant.extra else str(wheel)
    extras = ["pytest-django"] if name == "base" else []
    run([python, "-m", "pip", "install", "-q", requirement, *extras], quiet=True)
    for module in variant.absent:
        probe = f"import importlib.util as u; assert u.find_spec({module!r}) is None"
        run([python, "-c", probe])
    site = home / "site"
    site.mkdir()
    run([str(venv / "bin" / "django-admin"), "startproject", "mysite", str(site)])
    settings = site / "mysite" / "settings.py"
    settings.write_text(
        f"{settings.read_text()}\nINSTALLED_APPS += ['djlocks']\n{variant.settings}"
    )
    shutil.copytree(HOST_FILES / "smoke", site / "smoke")
    fresh_database(variant)

    def manage(*args: str, **options: object) -> str:
        return run([python, "manage.py", *args], cwd=site, **options)  # type: ignore[arg-type]

    print(manage("check", "--database", "default"), end="")
    manage("migrate", "--noinput", quiet=True)
    # Nothing the project's tests did may be lost from the history (a warning says so).
    print(manage("test", "--noinput", "-v", "2", "smoke", refuse="not recorded"), end="")
    if name == "base":
        shutil.copy(HOST_FILES / "pytest_locks.py", site / "test_locks.py")
        (site / "pytest.ini").write_text("[pytest]\nDJANGO_SETTINGS_MODULE = mysite.settings\n")
        print(run([python, "-m", "pytest", "-p", "no:cacheprovider", "test_locks.py"], cwd=site))
    with held_by_runlocked(python, site, variant.lock_backend):
        once = ["runlocked", HELD, "--backend", variant.lock_backend, "-n", "--", "true"]
        second = subprocess.run(
            [python, "manage.py", *once],
            cwd=site,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 75, f"second runlocked exited {second.returncode}: {second}"
        print(f"second runlocked while held: exit {second.returncode}; {second.stderr.strip()}")
        listing = json.loads(manage("djlocks", "list", "--json", quiet=True))
        labels = [holder["label"] for holder in listing["holders"] if holder["name"] == HELD]
        assert labels == [LABEL], f"djlocks list --json: {listing}"
        print(f"djlocks list --json: {HELD} held by {labels[0]!r}")
        metrics(python, site, variant)
        dashboard(python, site, home)


def metrics(python: str, site: Path, variant: Variant) -> None:
    """``djlocks metrics``: the exposition with the extra, a clear refusal without it."""
    scraped = subprocess.run(
        [python, "manage.py", "djlocks", "metrics"],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "prometheus" in (variant.extra or ""):
        assert scraped.returncode == 0, f"djlocks metrics: {scraped}"
        assert "# TYPE djlocks_acquisitions_total counter" in scraped.stdout, scraped.stdout
        print("djlocks metrics: the exposition format, with every djlocks metric")
    else:
        assert scraped.returncode == 2 and "djlocks[prometheus]" in scraped.stderr, scraped
        print(f"djlocks metrics without the extra: {scraped.stderr.strip()}")


@contextmanager
def held_by_runlocked(python: str, site: Path, backend: str) -> Iterator[None]:
    """A ``runlocked`` job holding ``HELD`` for as long as the block runs."""
    job = ["runlocked", HELD, "--backend", backend, "--label", LABEL, "--", "sleep", "600"]
    holder = subprocess.Popen(
        [python, "manage.py", *job],
        cwd=site,
    )
    try:
        deadline = time.monotonic() + 60
        while HELD not in run([python, "manage.py", "djlocks", "list"], cwd=site, quiet=True):
            assert holder.poll() is None, f"runlocked exited {holder.returncode}"
            assert time.monotonic() < deadline, "runlocked never took the lock"
            time.sleep(0.2)
        yield
    finally:
        holder.terminate()
        holder.wait(60)


def dashboard(python: str, site: Path, home: Path) -> None:
    """Log into the admin in headless Chromium and read the dashboard."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    password = "install-test-password"
    superuser = ["--noinput", "--username", "admin", "--email", "admin@example.com"]
    run(
        [python, "manage.py", "createsuperuser", *superuser],
        cwd=site,
        env={**os.environ, "DJANGO_SUPERUSER_PASSWORD": password},
        quiet=True,
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [python, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
        cwd=site,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    browser = None
    try:
        wait_for_http(f"{base}/admin/login/")
        browser = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
        browser.set_window_size(1400, 900)
        browser.get(f"{base}/admin/login/?next=/admin/djlocks/lockname/")
        browser.find_element(By.ID, "id_username").send_keys("admin")
        browser.find_element(By.ID, "id_password").send_keys(password)
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        deadline = time.monotonic() + 30
        while HELD not in browser.page_source:
            assert time.monotonic() < deadline, f"{HELD} not listed:\n{browser.page_source}"
            time.sleep(0.3)
            browser.refresh()
        browser.save_screenshot(str(home / "dashboard.png"))
        sparklines = browser.find_elements(By.CSS_SELECTOR, "td svg.djlocks-chart")
        assert sparklines and sparklines[0].size["height"] > 10, "no sparkline drawn"
        browser.find_element(By.LINK_TEXT, HELD).click()
        holder = browser.find_element(By.TAG_NAME, "body").text
        assert LABEL in holder and "runlocked" in holder, f"no holder shown:\n{holder}"
        sheets = browser.execute_script(
            "return Array.from(document.styleSheets).map(s => s.href || '')"
        )
        stylesheet = next(href for href in sheets if href.endswith("djlocks/dashboard.css"))
        with urllib.request.urlopen(stylesheet, timeout=10) as response:
            assert response.status == 200 and response.read(), stylesheet
        timeline = browser.find_element(By.CSS_SELECTOR, "svg.djlocks-chart")
        assert timeline.size["width"] > 500 and timeline.size["height"] > 40, timeline.size
        assert "slot 0" in timeline.text, f"the timeline has no lane:\n{timeline.text}"
        browser.save_screenshot(str(home / "dashboard-name.png"))
        print(f"dashboard: {HELD} held by {LABEL!r}, {stylesheet} served; screenshots in {home}")
    finally:
        if browser is not None:
            browser.quit()
        server.terminate()
        server.wait(30)


# -- helpers ---------------------------------------------------------------------


def fresh_database(variant: Variant) -> None:
    """An empty ``djlocks_install`` database on the server the variant uses."""
    if "postgresql" in variant.settings:
        import psycopg

        with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as db:
            db.execute("DROP DATABASE IF EXISTS djlocks_install WITH (FORCE)")
            db.execute("CREATE DATABASE djlocks_install")
    elif "mysql" in variant.settings:
        import MySQLdb

        db = MySQLdb.connect(host="127.0.0.1", user="root")
        try:
            db.cursor().execute("DROP DATABASE IF EXISTS djlocks_install")
            db.cursor().execute("CREATE DATABASE djlocks_install CHARACTER SET utf8mb4")
        finally:
            db.close()


def run(command: list[str], *, quiet: bool = False, refuse: str = "", **options: object) -> str:
    """Run ``command``; its output, or an ``AssertionError`` with it if it failed or
    printed ``refuse``."""
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        **options,  # type: ignore[call-overload]
    )
    if done.returncode != 0 or (refuse and refuse in done.stdout + done.stderr):
        raise AssertionError(
            f"{' '.join(command)} exited {done.returncode}"
            + (f" and printed {refuse!r}" if refuse and refuse in done.stdout + done.stderr else "")
            + f"\n{done.stdout}\n{done.stderr}"
        )
    if not quiet and done.stderr.strip():
        print(done.stderr, end="", file=sys.stderr)
    return str(done.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
