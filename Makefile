.PHONY: check test serve lint
# uv as the README installs it (python3 -m uv), else one on the PATH (pipx's)
ifndef UV
UV := $(shell python3 -m uv --version >/dev/null 2>&1 && echo python3 -m uv || echo uv)
endif
check:  ## lint, types and tests, as CI runs them
	bash scripts/check
test:
	$(UV) run --frozen pytest
serve:
	$(UV) run --frozen ai-backend serve
lint:  ## what scripts/check runs before the tests
	$(UV) run --frozen ruff check app tests && $(UV) run --frozen ruff format --check app tests \
		&& $(UV) run --frozen mypy app
