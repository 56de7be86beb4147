"""Take the dashboard's screenshots in the docs, in headless Chromium (``make screenshots``).

Runs the demo (``project/``) on a fresh SQLite file: its live workload of
``runlocked`` jobs for a few minutes, one forced release, then the overview and
the page of ``demo:pdf-render`` (its timeline of the last ten minutes),
written to ``docs/dashboard-overview.png`` and ``docs/dashboard-name.png``.
Needs Debian's ``chromium`` and ``chromium-driver`` (``make setup`` installs them).

Usage: python docs/screenshots.py [seconds of workload, default 150]
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 150.0
    with tempfile.TemporaryDirectory() as var:
        env = {**os.environ, "DJLOCKS_DB": "sqlite", "DJLOCKS_VAR_DIR": var}
        env.pop("REDIS_URL", None)  # the database backends only: nothing else to start

        def manage(*arguments: str) -> None:
            subprocess.run([sys.executable, "manage.py", *arguments], cwd=ROOT, env=env, check=True)

        password = secrets.token_urlsafe(16)
        manage("migrate", "--noinput", "-v", "0")
        manage("shell", "-c", _superuser(password))
        port = _free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "runserver",
                "--noreload",
                "--insecure",
                f"127.0.0.1:{port}",
            ],
            cwd=ROOT,
            env=env,
            stderr=subprocess.DEVNULL,
        )
        workload = subprocess.Popen(
            [sys.executable, "-m", "project.demo.workload"], cwd=ROOT, env=env
        )
        try:
            time.sleep(seconds / 2)
            manage("djlocks", "release", "demo:nightly-import", "--yes", "--reason", "screenshots")
            time.sleep(seconds / 2)
            _shoot(f"http://127.0.0.1:{port}", password)
        finally:
            workload.terminate()
            workload.wait(60)
            server.terminate()
            server.wait(30)


def _shoot(base: str, password: str) -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{base}/admin/login/", timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    browser = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        browser.set_window_size(1400, 1000)
        browser.get(f"{base}/admin/login/?next=/admin/djlocks/lockname/")
        browser.find_element(By.ID, "id_username").send_keys("admin")
        browser.find_element(By.ID, "id_password").send_keys(password)
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        time.sleep(1)
        browser.save_screenshot(str(DOCS / "dashboard-overview.png"))
        browser.get(
            f"{base}/admin/djlocks/lockname/name/?backend=default&name=demo:pdf-render&timeline=10m"
        )
        chart = browser.find_element(By.CSS_SELECTOR, "svg.djlocks-chart")
        assert chart.size["width"] > 500 and chart.size["height"] > 50, chart.size
        browser.set_window_size(1400, 2000)
        browser.save_screenshot(str(DOCS / "dashboard-name.png"))
    finally:
        browser.quit()


def _superuser(password: str) -> str:
    return (
        "from django.contrib.auth.models import User; "
        f"User.objects.create_superuser('admin', 'admin@example.com', {password!r})"
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


if __name__ == "__main__":
    main()
