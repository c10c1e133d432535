# The two commands a new user needs: `make run` (the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install clients run test lint unit integration bench bench-smoke bench-peers bench-gateway bench-prefix bench-sla bench-batch clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV) $(PYTHON)
	touch $(STAMP)

# The pinned agent CLIs (Codex, Claude Code, Cline) for the real-client tests, into .clients/.
clients:
	bash scripts/install-clients.sh

run: install
	$(PY) -m serve_app.cli run --config configs/local.yaml

test: install lint clients
	$(PY) -m pytest tests

# Type errors and lint findings fail `make test` (and so CI) before the suite runs.
lint: install
	$(VENV)/bin/ruff check serve_app loadtests tests dashboards
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest tests/unit

integration: install clients
	$(PY) -m pytest tests/integration

bench: install
	$(PY) -m loadtests.bench

bench-smoke: install
	$(PY) -m loadtests.bench --smoke

# The same load against direct vLLM, this gateway, Ray Serve LLM and the LiteLLM proxy; each peer
# is installed first into its own venv under results/bench/peers/venvs/ (never into .venv).
bench-peers: install
	$(PY) -m loadtests.bench.peers
	$(PY) -m loadtests.bench --peers

# Gateway capacity against a synthetic upstream (no engine), 1, 2 and 4 gateway replicas.
bench-gateway: install
	$(PY) -m loadtests.bench.gateway --replicas 1,2,4

# A ~10k-token shared system prompt: TTFT with prefix caching on and off, and per tenant.
bench-prefix: install
	$(PY) -m loadtests.bench.prefix

# The README's locust load (-u 12 and 24, -r 4, 2 minutes each), a light premium client and a /health prober,
# against Prometheus: per tier, locust's, the client's and Prometheus's TTFT p95, and the stages.
bench-sla: install
	$(PY) -m loadtests.bench.sla --users 12,24 --duration 120

# A 1,000-line chat batch (/v1/batches) beside the README's locust load, against the load alone:
# premium TTFT p95 and total output tokens/s ratios (docs/perf/batch.{md,png}).
bench-batch: install
	$(PY) -m loadtests.bench.batch

# The gateway's flow queue on vs off on configs/local.yaml (issue 23): tiers at 2x/4x the load where
# premium first misses its objective, a noisy and a quiet key, throughput; table + PNG.
.PHONY: bench-flow
bench-flow: install
	$(PY) -m loadtests.bench.flow

clean:
	rm -rf $(VENV) .local .pytest_cache

# Agent sessions over 2 replicas of tiny-chat (KV capped): the affinity router against Ray Serve's
# default router, in one run (docs/perf/affinity-*).
.PHONY: bench-affinity
bench-affinity: install
	$(PY) -m loadtests.bench.affinity

# 16 LoRA adapters of tiny-chat over 2 replicas (max_loras 4, Zipf popularity), real CPU engines:
# adapter-aware routing against Ray Serve's default router in one run: TTFT p50/p95, adapter loads
# per 1,000 requests, output tokens/s (issue 41; docs/perf/lora-routing-*).
.PHONY: bench-lora
bench-lora: install
	$(PY) -m loadtests.bench.lora_routing --results-dir docs/perf

# SIMULATED fleet (issue 39), SCENARIO=affinity (default): 8 simulated H100 replicas of
# Llama-3.1-8B per router, 64 agent sessions of 30k-token prompts, the affinity router against the
# default (docs/perf/fleet-*); SCENARIO=fairness: a noisy key beside 8 quiet keys on 4 simulated
# H100 replicas at 2x and 4x capacity (docs/perf/fleet-fairness-*); SCENARIO=all: both.
SCENARIO ?= affinity
.PHONY: bench-fleet
bench-fleet: install
	$(PY) -m loadtests.bench.fleet --scenario $(SCENARIO) --results-dir docs/perf

# The SIMULATED engine (cpu-tiny profile) against the real tiny-chat CPU engine, one live engine at
# a time: c1, c16, c64, prefix hit and miss; real vs simulated TTFT p50, TPOT p50 and throughput per
# cell, ±15 % marked (docs/perf/sim-validate-*; docs/PERFORMANCE.md).
.PHONY: bench-sim-validate
bench-sim-validate: install
	$(PY) -m loadtests.bench.sim_validate --repeats 3 --results-dir docs/perf
