.PHONY: check test serve lint
check:  ## lint, types and tests, as CI runs them
	bash scripts/check
test:
	python3 -m uv run --frozen pytest
serve:
	python3 -m uv run --frozen ai-backend serve
lint:  ## what scripts/check runs before the tests
	python3 -m uv run --frozen ruff check app tests && python3 -m uv run --frozen ruff format --check app tests \
		&& python3 -m uv run --frozen mypy app
