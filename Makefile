# Template development: a local .venv, the template tests, a demo bake.
# make demo installs requirements-demo.txt (bake and train); make test/test-slow/format all of requirements-dev.txt.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: test test-slow test-all format demo clean

# Creates $(VENV) if missing, with a Python 3.10+; pip itself is left as is.
define make-venv
	@$(PY) -c "import sys; sys.exit(sys.version_info < (3, 10))" || { echo "ERROR: $(PY) is missing or older than Python 3.10; run make PY=python3.X" >&2; exit 1; }
	$(VPY) -m pip --version >/dev/null 2>&1 || $(PY) -m venv $(VENV)
endef

# Each stamp is newer than its requirements files once the venv holds them.
$(VENV)/.installed-demo: requirements-demo.txt
	$(make-venv)
	$(VPY) -m pip install -r requirements-demo.txt
	touch $@

# requirements-dev.txt starts with -r requirements-demo.txt, so this venv holds the demo's too.
$(VENV)/.installed: requirements-dev.txt requirements-demo.txt
	$(make-venv)
	$(VPY) -m pip install -r requirements-dev.txt
	touch $@ $(VENV)/.installed-demo

# Bakes, refusals, ruff on the baked project, and the generated project's fast tier, on two pytest workers: the fast
# tiers one after the other (tests/test_generated_suite.py), the rest beside them.
test: $(VENV)/.installed
	$(VPY) -m pytest -q -rA tests -m "not slow" -n 2 --dist loadgroup

# The generated project's slow tier, once (torchrun, every resume case, signals, SLURM stand-ins, sweeps), then the
# Quick start test. One after the other: beside the slow tier, the Quick start's pip install slowed it from 15 to 19
# minutes and a SIGTERM test missed its save.
test-slow: $(VENV)/.installed
	$(VPY) -m pytest -q -rA tests -m slow

# Everything: what .ci/run runs, as the two steps above.
test-all: test test-slow

# ruff's fixes and formatting for the template's .py files (through a bake: the Jinja fields stop ruff reading them).
format: $(VENV)/.installed
	$(VPY) scripts/format_template.py

demo: $(VENV)/.installed-demo
	rm -rf scratch/my-trainer
	$(VPY) -m cookiecutter . --no-input -o scratch
	cd scratch/my-trainer && ../../$(VPY) train.py hydra.run.dir=outputs/demo
	@echo "TensorBoard logs: scratch/my-trainer/outputs/demo/tb"
	@echo "Checkpoint: scratch/my-trainer/outputs/demo/checkpoints/last.pth"
	@echo "View: .venv/bin/tensorboard --logdir scratch/my-trainer/outputs"

clean:
	rm -rf scratch
