# Set-up from nothing: a virtualenv in .venv with torch (CPU build unless TORCH_SPEC says otherwise),
# megatron-core and this package, and the OS's bubblewrap for the Python sandbox where root may install it. `make demo` runs the CPU demo (PPO; `make demo-grpo`: GRPO; `make demo-moe`: GRPO on a mixture of experts;
# `make demo-pipeline`: SFT, a reward model, PPO and DPO from preference pairs; `make demo-judge`: GRPO scored by an
# LLM judge); `make test` runs the test suite.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The demos write under DEMO_OUTPUTS (each into its own default directory, --overwrite'ing only its
# own earlier run) and read nothing the shell exports: a real run's OUTPUT_DIR, POLICY_LOAD, TP,
# ITERATIONS, ... never reach them (a clean environment).
DEMO_OUTPUTS ?= outputs
DEMO_ENV = env -i PATH="$$PATH" HOME="$$HOME" TMPDIR="$${TMPDIR:-/tmp}" LANG=C.UTF-8 OMP_NUM_THREADS=1
DEMO_RUN = $(DEMO_ENV) $(VENV)/bin/torchrun --nproc_per_node=$(NPROC) -m megatron_rlhf.train --overwrite

.PHONY: install demo demo-grpo demo-moe demo-math demo-agent demo-pipeline demo-judge test clean

install: $(STAMP)

$(STAMP): setup.py
	bash tools/install_sandbox.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so that no dependency range can pull a newer (CUDA) build.
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	# TRL's PRMTrainer, the process reward model's reference (tests/test_prm.py), left TRL after 0.29:
	# that release alone, apart from the TRL above, imported only by that check's own process.
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/peers/trl-0.29.1 trl==0.29.1
	touch $(STAMP)

# The demo's synthetic prompts, regenerated when their generator changes.
examples/tiny/prompts.jsonl: examples/tiny/make_prompts.py
	$(PYTHON) examples/tiny/make_prompts.py $@

demo: $(STAMP) examples/tiny/prompts.jsonl
	$(DEMO_RUN) --config examples/tiny/rlhf.yaml --output-dir $(DEMO_OUTPUTS)/demo

# The same demo without a critic: GRPO (examples/tiny/grpo.yaml).
demo-grpo: $(STAMP) examples/tiny/prompts.jsonl
	$(DEMO_RUN) --config examples/tiny/grpo.yaml --output-dir $(DEMO_OUTPUTS)/demo-grpo

# GRPO on a mixture of experts, the experts split over the processes (examples/tiny/moe.yaml).
demo-moe: $(STAMP) examples/tiny/prompts.jsonl
	$(DEMO_RUN) --config examples/tiny/moe.yaml --output-dir $(DEMO_OUTPUTS)/demo-moe

# GRPO with verifiable rewards: a Hugging Face tokenizer with a chat template, chat rows with ground
# truth, the built-in verifier, validation (examples/tiny_math/grpo.yaml). Its inputs are committed;
# make_data.py writes them again when it changes.
examples/tiny_math/train.jsonl: examples/tiny_math/make_data.py | $(STAMP)
	$(PY) examples/tiny_math/make_data.py

demo-math: $(STAMP) examples/tiny_math/train.jsonl
	$(DEMO_RUN) --config examples/tiny_math/grpo.yaml --output-dir $(DEMO_OUTPUTS)/demo-math

# An agent: GRPO where the policy plays a 4-turn game against an environment whose replies say the
# next correct move; only the policy's tokens are trained (examples/tiny_agent/grpo.yaml).
demo-agent: $(STAMP) examples/tiny/prompts.jsonl
	$(DEMO_RUN) --config examples/tiny_agent/grpo.yaml --output-dir $(DEMO_OUTPUTS)/demo-agent

# From preferences to a policy: SFT, a reward model from pairs labelled by a hidden rule, PPO against
# it and DPO on the same pairs, each scored on the hidden rule (examples/tiny_pipeline/run_pipeline.sh).
examples/tiny_pipeline/pairs.jsonl: examples/tiny_pipeline/make_data.py
	$(PYTHON) examples/tiny_pipeline/make_data.py examples/tiny_pipeline

demo-pipeline: $(STAMP) examples/tiny_pipeline/pairs.jsonl
	$(DEMO_ENV) BIN=$(VENV)/bin NPROC=$(NPROC) OUT=$(DEMO_OUTPUTS)/pipeline bash examples/tiny_pipeline/run_pipeline.sh

# Rewards from a model that reads: a tiny judge taught by SFT to rate answers by the pipeline demo's
# hidden rule, then GRPO scored by the judge alone, the hidden rule measured before and after
# (examples/tiny_judge/run_demo.sh).
examples/tiny_judge/ratings.jsonl: examples/tiny_judge/make_data.py examples/tiny_judge/judge_template.txt | $(STAMP)
	$(PY) examples/tiny_judge/make_data.py examples/tiny_judge

demo-judge: $(STAMP) examples/tiny_judge/ratings.jsonl
	$(DEMO_ENV) BIN=$(VENV)/bin NPROC=$(NPROC) OUT=$(DEMO_OUTPUTS)/judge bash examples/tiny_judge/run_demo.sh

test: $(STAMP)
	bash tests/helpers/setup_slurm.sh
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build *.egg-info
