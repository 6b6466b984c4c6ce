# `make test` and `make demo` work on a machine with nothing but Python: each builds .venv once,
# then reuses it (the stamp is rebuilt when pyproject.toml, setup.py or the C extension changes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.growcache-installed
# CPU builds for the test machine; users installing growcache[torch,tf] keep their own builds.
CPU_FRAMEWORKS := torch==2.13.0 tensorflow-cpu==2.21.0

.PHONY: test demo venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py growcache/_frames.c Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24" "setuptools>=77" wheel
	$(BIN)/python -m pip install -q $(CPU_FRAMEWORKS) "tfrecord>=1.14"
	$(BIN)/python -m pip install -q $(CPU_FRAMEWORKS) -e ".[test,test-trainers,s3,gcs,bench]"
	touch $(STAMP)

# TensorFlow and the `tfrecord` package cannot share one process (both register
# tensorflow.BytesList in protobuf's pool), so TF tests run in a pytest process of their own.
# --durations prints the slowest tests, to keep the suite inside its time budget. Two pytest-xdist
# workers (-n 2): many tests wait on subprocesses, servers and timeouts, so two at a time take
# about 20% less wall time on 2 cores; --dist loadfile keeps a file's tests, and the expensive
# module fixtures (the throughput benchmark, the S3 and GCS servers), on one worker.
# -rs ends each run with every skip and its reason; under CI=true a skipped required
# component (TensorFlow, torch, tfrecord, the S3/GCS servers, a size-limited filesystem)
# fails instead (tests/conftest.py).
test: $(STAMP)
	@status=0; \
	$(BIN)/python -m pytest -q -rs --durations=20 -n 2 --dist loadfile tests --ignore=tests/tf || status=1; \
	$(BIN)/python -m pytest -q -rs --durations=20 -n 2 --dist loadfile tests/tf || status=1; \
	exit $$status

demo: $(STAMP)
	$(BIN)/growcache demo

bench: $(STAMP)
	$(BIN)/python benchmarks/shard_io.py

clean:
	rm -rf $(VENV) build *.egg-info
