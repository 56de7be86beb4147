# One command sets up and runs each job. PYTHON may name another interpreter.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-sqlite test-postgresql test-mysql test-newest reliability lint docs bench clean install-test screenshots

# The tests and the benchmark need a Redis: REDIS_URL, the loopback one unless set, is
# exported to them only. `make demo` uses Redis only if REDIS_URL is in its environment.
REDIS_URL ?= redis://127.0.0.1:6379/0
test-sqlite test-postgresql test-mysql test-newest reliability bench: export REDIS_URL := $(REDIS_URL)

$(STAMP): requirements.txt pyproject.toml Makefile
	@pkg-config --exists libmariadb 2>/dev/null || pkg-config --exists mysqlclient 2>/dev/null || \
	  (command -v apt-get >/dev/null && apt-get update -q && apt-get install -y -q libmariadb-dev pkg-config)
	@command -v redis-server >/dev/null || \
	  (command -v apt-get >/dev/null && apt-get update -q && apt-get install -y -q redis-server)
	@# PgBouncer: the tests put one in transaction pooling mode in front of PostgreSQL.
	@test -x /usr/sbin/pgbouncer || \
	  (command -v apt-get >/dev/null && apt-get update -q && apt-get install -y -q pgbouncer)
	@# Chromium and its driver: the installation test loads the admin dashboard in them.
	@test -x /usr/bin/chromedriver || \
	  (command -v apt-get >/dev/null && apt-get update -q && apt-get install -y -q chromium chromium-driver)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e . --no-deps
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) manage.py migrate --noinput
	$(PY) manage.py djlocks stress --processes 8 --iterations 100
	$(PY) manage.py djlocks stress --processes 8 --iterations 50 --limit 3 --hold-ms 5
	$(PY) manage.py djlocks stress --processes 8 --iterations 10 --via runlocked
	@if [ -n "$$REDIS_URL" ]; then \
	  $(PY) manage.py djlocks stress --backend redis --processes 8 --iterations 100; \
	  $(PY) manage.py djlocks stress --backend redis --processes 8 --iterations 50 --limit 3 --hold-ms 5; \
	fi
	@# A new random password at each run, printed once: the demo has no fixed login.
	@$(PY) manage.py demo_superuser
	@echo "A live workload of runlocked jobs runs next to the server until you stop it (Ctrl-C)."
	$(PY) -m project.demo.workload & workload=$$!; \
	  trap 'kill $$workload 2>/dev/null; wait $$workload' EXIT INT TERM; \
	  $(PY) manage.py runserver --noreload --insecure 127.0.0.1:8000

test: setup test-sqlite test-postgresql test-mysql

# The SQLite leg also runs the lease tests on a private Redis Cluster, which
# tests/redis_cluster.py starts around the run.
test-sqlite: setup
	DJLOCKS_DB=sqlite $(PY) -m tests.redis_cluster $(PY) -m pytest -m "not one_database"

# The Redis backend's tests (marker redis_store) use the database only for the history,
# so the SQLite leg runs them and the server legs leave them out: Redis is tested once.
# What is the same on every database (marker one_database: real gunicorn, uvicorn and
# Celery workers whose renewals do not depend on the driver, runlocked's strength tests)
# runs in the PostgreSQL leg only.
test-postgresql: setup
	DJLOCKS_DB=postgresql $(PY) -m pytest -m "not redis_store"

test-mysql: setup
	DJLOCKS_DB=mysql $(PY) -m pytest -m "not redis_store and not one_database"

# The fault catalogue (tests/catalogue.py): its tests (part of `make test`) on the three databases,
# the SQLite leg with the Redis Cluster as in `make test-sqlite`, ROUNDS times in a row, then
# docs/reliability.md from the last round's results.
ROUNDS ?= 1
reliability: setup
	set -e; for round in $$(seq $(ROUNDS)); do \
	  rm -rf var/catalogue; \
	  DJLOCKS_DB=sqlite DJLOCKS_CATALOGUE_DIR=var/catalogue \
	    $(PY) -m tests.redis_cluster $(PY) -m pytest -q -m catalogue; \
	  for db in postgresql mysql; do \
	    DJLOCKS_DB=$$db DJLOCKS_CATALOGUE_DIR=var/catalogue $(PY) -m pytest -q -m catalogue; \
	  done; \
	done
	$(PY) -m tests.catalogue var/catalogue > docs/reliability.md

# The benchmark workloads (bench/) on the three databases and Redis; QUICK=1 for a short run.
bench: setup
	$(PY) -m pip install -q -r requirements-bench.txt
	$(PY) bench/run.py $(if $(QUICK),--quick)

# djlocks as a new user gets it: the wheel in fresh virtualenvs, one per extra, in a
# project made by django-admin startproject (tests/installation.py).
install-test: setup
	$(PY) -m tests.installation

# The dashboard's screenshots in docs/, from the demo's live workload in headless Chromium.
screenshots: setup
	$(PY) docs/screenshots.py

lint: setup
	$(VENV)/bin/ruff check djlocks project tests bench docs/screenshots.py
	$(VENV)/bin/ruff format --check djlocks project tests bench docs/screenshots.py
	$(VENV)/bin/mypy
	DJLOCKS_DB=sqlite $(PY) manage.py makemigrations --check --dry-run

# The documentation site (Sphinx, MyST Markdown, furo) into var/docs-html: warnings are
# errors and every cross-reference must resolve. Needs no database server (docs/conf.py
# configures the demo project on SQLite, with its scratch files in /tmp/docs-var).
docs: setup
	$(PY) -m pip install -q -r requirements-docs.txt
	$(VENV)/bin/sphinx-build -W --keep-going -n -b html docs var/docs-html

clean:
	rm -rf $(VENV) $(NEWEST_VENV) var

# The newest Django (6.x needs Python 3.12+) on the newest Python the machine has: the
# suite but for what tests the stores and workers rather than Django (the fault catalogue,
# the many-process strength tests, real gunicorn/uvicorn/Celery workers), which `make test`
# runs; requirements-newest.txt adds a real queue for Django's tasks framework, new in
# Django 6.
NEWEST_PYTHON ?= $(shell ls -d $(HOME)/.pyenv/versions/3.13*/bin/python3 $(HOME)/.pyenv/versions/3.12*/bin/python3 2>/dev/null | head -1)
NEWEST_VENV := .venv-newest

test-newest: setup
	@if [ -z "$(NEWEST_PYTHON)" ]; then echo "No Python >= 3.12 here: skipping the newest-Django run."; exit 0; fi; \
	set -e; \
	stamp=$(NEWEST_VENV)/.installed; \
	[ -f $$stamp ] && [ $$stamp -nt requirements.txt ] && [ $$stamp -nt requirements-newest.txt ] || { \
	  rm -rf $(NEWEST_VENV); \
	  $(NEWEST_PYTHON) -m venv $(NEWEST_VENV); \
	  $(NEWEST_VENV)/bin/pip install -q --upgrade pip; \
	  grep -v '^Django==' requirements.txt | $(NEWEST_VENV)/bin/pip install -q -r /dev/stdin -r requirements-newest.txt; \
	  $(NEWEST_VENV)/bin/pip install -q -e . --no-deps; \
	  touch $(NEWEST_VENV)/.installed; }; \
	$(NEWEST_VENV)/bin/python -m django --version; \
	DJLOCKS_DB=sqlite $(NEWEST_VENV)/bin/python -m pytest -q -m "not real_workers and not catalogue and not strength"; \
	for db in postgresql mysql; do \
	  DJLOCKS_DB=$$db $(NEWEST_VENV)/bin/python -m pytest -q -m "not redis_store and not real_workers and not catalogue and not strength"; done
