# One entry point for setup, the main job and the tests. Every pin lives in constraints.txt.
VENV      := .venv
PY        := $(VENV)/bin/python
# Two installs into the one venv: the package alone (what `make run` needs), and the package with
# the `test` extra (the suite, lint, benchmarks: every other extra too). Each has its stamp, so
# `make run` from a fresh clone installs no pytest, moto or matplotlib, and `make test` after it
# adds them.
RUN_STAMP := $(VENV)/.installed-run
STAMP     := $(VENV)/.installed
PYTHON3   ?= python3

.PHONY: install install-run run lint test test-unit test-gpu bench bench-full clean

$(RUN_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e .
	$(PY) -m pip check
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip check
	touch $(STAMP)

install-run: $(RUN_STAMP)

install: $(STAMP)

# The main job with its defaults: small GPT, 2..3 workers, file storage under runs/.
RUN_ARGS ?= --storage runs/pretrain --workers 2:3 --steps 200 --checkpoint-every 50
run: install-run
	$(PY) examples/pretrain.py $(RUN_ARGS)

# ruff (style, imports, bugbear, blind excepts) over the code and the tests; mypy over the
# packages and the unit tests' fakes, which tests/unit/controller/protocol_checks.py holds to the
# controller's Protocols (both tools configured in pyproject.toml).
lint: install
	$(PY) -m ruff check elastic checkpointing chaos tests examples benchmarks
	$(PY) -m mypy

# Lint first, then two passes over the whole suite. Most tests run two at a time (pytest-xdist):
# one test's waiting (process starts, Ray start-up, polls) overlaps another's work; `worksteal`
# lets the idle process take queued tests from the busy one, so the pass does not end on one
# process running a long integration test while the other has nothing left. Tests marked
# `exclusive` measure time or need the whole machine (straggler scores, detection bounds,
# clusters) and run alone afterwards. The target fails if either pass fails.
test: install lint
	$(PY) -m pytest -n 2 --dist worksteal -m "not exclusive"; parallel=$$?; \
	$(PY) -m pytest -m exclusive; alone=$$?; \
	test $$parallel -eq 0 && test $$alone -eq 0

# The pure unit layer: no process started (tests that start one are marked `multiprocess`), about
# half a minute here. tests/unit mirrors the packages: controller/, worker/, ckpt/ (checkpointing).
test-unit: install
	$(PY) -m pytest tests/unit -m "not multiprocess"

# The GPU suite (tests/gpu): NCCL, CUDA staging, bf16/fp16, FSDP2 on one CUDA GPU. Without CUDA
# every test there is skipped (`make test` collects them too, and skips them on CPU machines).
test-gpu: install
	$(PY) -m pytest tests/gpu -v

# Side-by-side benchmarks (benchmarks/peers.py): each writes its JSON line to $(BENCH_OUT)/NAME.json
# and a PNG to $(BENCH_OUT)/NAME.png. `bench` is a quick set (about 8 minutes on 2 cores);
# `bench-full` the settings reported in BENCHMARKS.md (about 30 minutes; R2 waits out its cap).
BENCH_OUT ?= runs/bench
PEERS     := $(PY) benchmarks/peers.py
bench: install
	$(PEERS) recovery --trials 1 --steps 80 --plot $(BENCH_OUT)/r1.png --out $(BENCH_OUT)/r1.json
	$(PEERS) recovery --trials 1 --steps 80 --signal STOP --heartbeat-timeout 3 --cap-s 30 \
	    --plot $(BENCH_OUT)/r2.png --out $(BENCH_OUT)/r2.json
	$(PEERS) throughput --steps 80 --reps 2 --plot $(BENCH_OUT)/o1.png --out $(BENCH_OUT)/o1.json
	$(PEERS) checkpoint --mb 64 --reps 2 --plot $(BENCH_OUT)/c1_dcp.png --out $(BENCH_OUT)/c1_dcp.json

bench-full: install
	$(PEERS) recovery --trials 3 --plot $(BENCH_OUT)/r1.png --out $(BENCH_OUT)/r1.json
	$(PEERS) recovery --trials 2 --signal STOP --heartbeat-timeout 3 --cap-s 120 \
	    --plot $(BENCH_OUT)/r2.png --out $(BENCH_OUT)/r2.json
	$(PEERS) recovery --trials 2 --signal STOP --heartbeat-timeout 3 --raytrain-health-timeout 3 \
	    --plot $(BENCH_OUT)/r2_tuned.png --out $(BENCH_OUT)/r2_tuned.json
	$(PEERS) throughput --workers 2 --steps 150 --reps 6 --plot $(BENCH_OUT)/o1.png --out $(BENCH_OUT)/o1.json
	$(PEERS) throughput --workers 4 --steps 100 --reps 2 --plot $(BENCH_OUT)/o1_w4.png --out $(BENCH_OUT)/o1_w4.json
	$(PEERS) checkpoint --mb 256 --reps 3 --plot $(BENCH_OUT)/c1_dcp.png --out $(BENCH_OUT)/c1_dcp.json

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
