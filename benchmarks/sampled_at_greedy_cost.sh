#!/usr/bin/env bash
# Issue 64, item 2 (sampled decoding at greedy cost), one call on a lent GPU with the wheels in .whl/ (carry .whl):
#   bash benchmarks/sampled_at_greedy_cost.sh [checks] [micro] [e2e]
# checks: the sampler kernels' tests on this GPU, compiled (the kernels dividing by the temperature as they load
#   against XLA's division of the scaled copy, and the block-maxima ways through the whole sampler);
# micro: the sampler alone (benchmarks/sampler.py, 256 x 128,256, the mixed rows) under each way the kernels' block
#   maxima are taken (CAPSTAN_SAMPLER_PREMAXIMA: "" after the bias from the scaled copy, "load" no copy: the kernels
#   scale as they load) and masses summed (CAPSTAN_SAMPLER_MASSES), each with a trace (trace_summary.py);
# e2e: the mixed workload all greedy, sampled as committed and sampled with PREMAXIMA=load, as gpu_suite.sh's
#   `sampling` part runs it (Llama-3.2-1B shape, 256 x 256 -> 256), on random weights' flat rows and on peaked ones
#   (PEAKED="0 4": throughput.py --peaked).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/sampled_at_greedy_cost.log") 2>&1  # a call cut at its limit keeps what was printed
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site/capstan && ln -sfn "$PWD/capstan/__init__.py" /tmp/site/capstan/__init__.py
ln -sfn "$PWD/runtime" /tmp/site/capstan/runtime && ln -sfn "$PWD/operator" /tmp/site/capstan/operator
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jcc} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in ${*:-checks micro e2e}; do echo "=== $part"; case $part in
  checks) python3 -m pytest -q -p no:cacheprovider tests/test_sampler_filters.py -k "kernel or scaling" 2>&1 \
      | grep --line-buffered -E "passed|failed|FAILED|Error" ;;
  micro) for v in ${VARIANTS:-:16 load:16}; do pm=${v%%:*}; ms=${v#*:}; echo "--- PREMAXIMA='$pm' MASSES=$ms"
      rm -rf /tmp/st; CAPSTAN_SAMPLER_PREMAXIMA=$pm CAPSTAN_SAMPLER_MASSES=$ms python3 benchmarks/sampler.py --rows 256 \
        --vocab 128256 --methods kernels --branches static --distributions ${DISTS:-flat} --repeats 30 \
        --trace /tmp/st 2>&1 | grep -v Warning
      [ -d /tmp/st/flat-kernels ] && python3 benchmarks/trace_summary.py /tmp/st/flat-kernels --top 14; done ;;
  e2e) for gain in ${PEAKED:-0 4}; do for run in "--all-greedy:" ":" ":load"; do IFS=: read -r greedy pm <<< "$run"
      echo "--- mixed peaked $gain $greedy PREMAXIMA='$pm'"
      CAPSTAN_SAMPLER_PREMAXIMA=$pm python3 benchmarks/throughput.py --shape llama-3.2-1b --peaked $gain \
        --workload mixed $greedy --requests 256 --prompt-len 256 --output-len 256 --max-num-seqs 256 \
        --max-num-batched-tokens 2048 --smallest-bucket 256 --timeline --json "$OUT/mixed$greedy-$gain-$pm.json" 2>&1 \
        | grep --line-buffered -E "output_tokens|phase|timeline|compiles|Error"; done; done ;;
esac; done
