# The two commands a newcomer runs: `make demo` (the main job on embedded defaults) and `make test`.
.PHONY: install demo test bench clean

install:
	@bash infra/install.sh

demo: install
	.venv/bin/leap demo

test: install
	.venv/bin/lint-imports
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q --durations=25 tests

bench: install
	.venv/bin/leap bench predictor --json
	.venv/bin/leap bench rls --dim 576 --batch 8 --json
	.venv/bin/leap bench rls --dim 4096 --batch 8 --json

clean:
	rm -rf .leap
