# Template development: a local .venv with requirements-dev.txt, the template tests, a demo bake.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: test test-slow test-all format demo clean

# The stamp is newer than requirements-dev.txt once the venv holds it; pip itself is left as is.
$(VENV)/.installed: requirements-dev.txt
	@$(PY) -c "import sys; sys.exit(sys.version_info < (3, 10))" || { echo "ERROR: $(PY) is missing or older than Python 3.10; run make PY=python3.X" >&2; exit 1; }
	$(VPY) -m pip --version >/dev/null 2>&1 || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -r requirements-dev.txt
	touch $@

# Bakes, refusals, ruff on the baked project, and the generated project's fast tier (under 12 minutes on 2 cores).
test: $(VENV)/.installed
	$(VPY) -m pytest -q -rA tests -m "not slow"

# The generated project's slow tier, once (torchrun, every resume case, signals, SLURM stand-ins, sweeps).
test-slow: $(VENV)/.installed
	$(VPY) -m pytest -q -rA tests -m slow

# Everything: what .ci/run runs, as the two steps above.
test-all: test test-slow

# ruff's fixes and formatting for the template's .py files (through a bake: the Jinja fields stop ruff reading them).
format: $(VENV)/.installed
	$(VPY) scripts/format_template.py

demo: $(VENV)/.installed
	rm -rf scratch/my-trainer
	$(VPY) -m cookiecutter . --no-input -o scratch
	cd scratch/my-trainer && ../../$(VPY) train.py hydra.run.dir=outputs/demo
	@echo "TensorBoard logs: scratch/my-trainer/outputs/demo/tb"
	@echo "Checkpoint: scratch/my-trainer/outputs/demo/checkpoints/last.pth"
	@echo "View: .venv/bin/tensorboard --logdir scratch/my-trainer/outputs"

clean:
	rm -rf scratch
