# phalanx: `make demo` runs the main job, `make test` the tests, `make bench` the benchmarks.
# Each creates .venv when missing and installs pinned dependencies (constraints.txt).

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
WHEELS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIN    := -c constraints.txt $(WHEELS)

.PHONY: demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q $(PIN) torch==2.13.0
	$(PIP) install -q $(PIN) --only-binary hivemind hivemind==1.1.12
	$(PIP) install -q $(PIN) --no-build-isolation -e '.[data,watch,test]'
	-command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 || echo "no chromium: the watch page test will skip"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m phalanx.cli simulate digits-dp --out runs/demo
	$(PY) -m phalanx.cli report runs/demo

test: $(STAMP)
	$(PY) -m pytest -n 2

$(VENV)/.bench: $(STAMP)
	$(PIP) install -q $(PIN) --no-deps byzfl==0.0.11
	touch $(VENV)/.bench

bench: $(VENV)/.bench
	$(PY) bench/aggregators.py
	$(PY) bench/transport_throughput.py
	$(PY) bench/allreduce.py
	$(PY) bench/sim_scale.py

clean:
	rm -rf $(VENV) runs
