# Every target creates .venv if missing and installs stratkit into it,
# so each is one command on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stratkit-installed
# Spark must bind loopback: this machine's hostname resolves to another interface.
export SPARK_LOCAL_IP ?= 127.0.0.1
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONUNBUFFERED := 1

.PHONY: install demo test test-ray test-tune test-hosts test-cluster test-bench test-keras test-fast bench compat docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[spark,ray,storage,lake,mlflow,tune,test,examples,bench,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The version-gate tests run Keras releases below the floor from a cache; tests themselves install nothing.
COMPAT_OVERLAYS := $(HOME)/.cache/stratkit-compat/keras-3.3.3/keras/__init__.py $(HOME)/.cache/stratkit-compat/keras-3.10.0/keras/__init__.py

$(COMPAT_OVERLAYS): | $(STAMP)
	$(PY) tools/compat.py overlay 3.3.3 3.10.0

# The storage tests' Azure server: Azurite (an npm package; node and npm come with the machine). Tests install
# nothing: without it the Azure tests skip, or fail under STRATKIT_REQUIRE_STORES=1 (CI).
AZURITE_VERSION := 3.37.0
AZURITE := $(HOME)/.cache/stratkit-test/azurite/node_modules/.bin/azurite-blob

$(AZURITE):
	npm install --prefix $(HOME)/.cache/stratkit-test/azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)

# The Ray engine's tests (marker `ray`: real local Ray and Ray clusters on test hosts, ~5 min, plus 3-4.5 min for
# tests/ray/test_ray_node_loss.py and 2.5-4 min for tests/ray/test_ray_preemption.py) run in their own
# target so `make test` stays within its time budget; CI (.ci/run) runs both.
# Two pytest-xdist workers, one module whole in one worker, longest modules first (tests/conftest.py).
TEST_WORKERS ?= 2
# TEST_TIMES=out/test-times.json: each test's wall and CPU time with its children's, the load beside the run and
# the TensorFlow imports paid (tests/cpu_times.py; tables: python tools/test_times.py out/test-times.json).
TIMES = $(if $(TEST_TIMES),--times $(TEST_TIMES))
test: $(STAMP) $(COMPAT_OVERLAYS) $(AZURITE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(TIMES) -m "not ray and not hosts and not storage_hosts and not tune_acceptance and not bench_long"

test-ray: $(STAMP)
	$(PY) -m pytest -q --durations=10 $(TIMES) -m "ray and not tune_acceptance"

# Issue 51's long search acceptance runs (marker tune_acceptance, ~9 min of tests at load 10 on 2 cores): the
# seeded RandomSearch + Hyperband on 2 Spark executors and over Spark Connect, LocalRunner(tune=True), a killed
# chief resuming from S3, 2 multi-worker trial groups, an srun step imitated on one host, the Optuna example on
# Spark and under launch (Keras with its pruning callback). make test keeps one strong run of each path (launch,
# a killed and a hung tuner, Spark with a killed tuner, Optuna under launch and LocalRunner, MLflow). Also here,
# to keep CI within its time: the Ray searches (tests/ray/test_ray_tune.py, ~5.5 min) and the searches on test
# hosts (real Slurm daemons, a standalone Spark cluster: tests/test_*_tune_hosts.py). Not in CI (.ci/run).
test-tune: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(TIMES) -m tune_acceptance

# The several-machine tests on test hosts (network namespaces; need root): marker `hosts` (launch --nnodes on two
# hosts, elastic hosts, Spark standalone clusters, Slurm daemons, the elastic benchmark) and `storage_hosts` (issue
# 44 on hosts that share no disk: tests/test_storage_hosts.py, ~4-6 min, each lost or drained host replaced by a
# fresh one that resumes from an S3 server on a host of its own). Their Ray tests run in test-ray. In their own
# target so `make test` stays within its 35 minutes; CI runs every target. Two xdist workers as in `make test`.
test-hosts: $(STAMP) $(AZURITE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(TIMES) -m "(hosts or storage_hosts) and not ray and not tune_acceptance"

# Keras's own tests (from the installed Keras wheel: tf.distribute, losses, optimizers, BatchNorm, saving, ...),
# once plain and once with stratkit's Keras patches; fails on any test that passes plain and not patched
# (tools/keras_tests.py; logs and result.json in out/keras-tests). The two passes run side by side.
KERAS_TEST_JOBS ?= 2
test-keras: $(STAMP)
	$(PY) tools/keras_tests.py --jobs $(KERAS_TEST_JOBS)

# test-hosts and test-ray in one run, as CI runs them: one xdist worker takes the Ray modules one after another
# (tests/conftest.py RAY_MODULES: one work unit, first) while the other takes the test-host modules. Each target
# alone leaves a core mostly idle (Ray's serially, the elastic tests waiting on events): side by side they took
# 17.3 min, against 11.6 + 17.9 min one after the other (2 cores, load 2-5).
test-cluster: $(STAMP) $(AZURITE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(TIMES) -m "(ray or hosts or storage_hosts) and not tune_acceptance"

# The benchmarks' longest --quick runs (marker bench_long: scaling, spark, ps; ~6 min). Not in make test nor CI, to
# keep CI within its time; `make bench` runs the scripts whole.
test-bench: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TIMES) -m "bench_long and not hosts"

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The docs site into site/. --strict (also in mkdocs.yml): any warning, broken link or missing anchor fails.
# tests/test_docs.py runs the same build, so `make test` (and CI) fails on a broken page too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# Not part of `make test`: the version-sensitive tests on every supported
# (TensorFlow, Keras) pair, in cached environments (~/.cache/stratkit-compat).
# One pair: make compat TF=2.16.2 KERAS=3.16.0
compat: $(STAMP)
	$(PY) tools/compat.py run $(if $(TF),--tf $(TF)) $(if $(KERAS),--keras $(KERAS)); \
	status=$$?; $(PY) tools/compat.py render && exit $$status

clean:
	rm -rf $(VENV) build site *.egg-info
