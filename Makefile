# The two commands a newcomer needs: `make demo` and `make test`. Both set up what is missing first.
VENV := .venv
FLYWHEEL := $(VENV)/bin/flywheel
PYTEST := $(VENV)/bin/python -m pytest --durations=15  # the slowest tests, named at the end of every run
DEMO_MINUTES ?=  # empty: the recipe's (infra/recipes/tool_use.toml: 15); `make demo DEMO_MINUTES=20` for longer

.PHONY: setup demo test test-fast lint test-unit test-integration up down status model clean

setup:
	@bash infra/setup.sh

model: setup
	@$(FLYWHEEL) model init

demo: setup
	@$(FLYWHEEL) demo $(if $(strip $(DEMO_MINUTES)),--minutes $(DEMO_MINUTES))

# The test command CI runs: lint and types first (zero findings), then the tests. Integration tests start
# the real Kafka, MLflow and vLLM themselves (once per session, through infra/) and stop what they started.
test: model lint
	@$(PYTEST) tests/unit tests/integration tests/gpu

# The loop while you work, not what CI runs: every test but those marked slow (the closed-loop runs and their
# pre-flights, the kill loops and outages, the chaos small run), so the demo's and the swarm's builds are skipped.
test-fast: model lint
	@$(PYTEST) -m "not slow" tests/unit tests/integration tests/gpu

lint: setup
	@$(VENV)/bin/ruff check infra ingest learner serving rewards tests bench
	@$(VENV)/bin/python -m mypy -p flywheel

test-unit: model
	@$(PYTEST) tests/unit

test-integration: model
	@$(PYTEST) tests/integration

up: model
	@$(FLYWHEEL) infra up

down:
	@$(FLYWHEEL) infra down

status:
	@$(FLYWHEEL) status

clean: down
	rm -rf var/lake var/mlflow var/policies var/report var/kafka/data var/run
