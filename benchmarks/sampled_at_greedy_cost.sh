#!/usr/bin/env bash
# Issue 64, item 2 (sampled decoding at greedy cost), one call on a lent GPU with the wheels in .whl/ (carry .whl):
#   bash benchmarks/sampled_at_greedy_cost.sh [micro] [e2e]
# micro: the sampler alone (benchmarks/sampler.py, 256 x 128,256, the mixed rows) under each way the kernels' block
#   maxima are taken (CAPSTAN_SAMPLER_PREMAXIMA: "" after the bias, "scaled", "raw") and masses summed
#   (CAPSTAN_SAMPLER_MASSES), with a trace of the old and new ways (trace_summary.py);
# e2e: the mixed workload all greedy, sampled as committed, and sampled the old way (PREMAXIMA="" MASSES=16), as
#   gpu_suite.sh's `sampling` part runs it (Llama-3.2-1B shape, 256 x 256 -> 256).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site/capstan && ln -sfn "$PWD/capstan/__init__.py" /tmp/site/capstan/__init__.py
ln -sfn "$PWD/runtime" /tmp/site/capstan/runtime && ln -sfn "$PWD/operator" /tmp/site/capstan/operator
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in ${*:-micro e2e}; do echo "=== $part"; case $part in
  micro) for v in ${VARIANTS:-:16 :8 scaled:8 raw:8}; do pm=${v%%:*}; ms=${v#*:}; echo "--- PREMAXIMA='$pm' MASSES=$ms"
      rm -rf /tmp/st; CAPSTAN_SAMPLER_PREMAXIMA=$pm CAPSTAN_SAMPLER_MASSES=$ms python3 benchmarks/sampler.py --rows 256 \
        --vocab 128256 --methods kernels --branches static --distributions ${DISTS:-flat} --repeats 30 \
        $([ "$v" = ":16" ] || [ "$v" = "scaled:8" ] && echo --trace /tmp/st) 2>&1 | grep -v Warning
      [ -d /tmp/st/flat-kernels ] && python3 benchmarks/trace_summary.py /tmp/st/flat-kernels --top 14; done ;;
  e2e) for run in "--all-greedy::8" "::8" "::16:old"; do IFS=: read -r greedy pm ms old <<< "$run"
      [ -z "$pm" ] && [ -z "$old" ] && pm=scaled
      echo "--- mixed $greedy PREMAXIMA='$pm' MASSES=$ms"
      CAPSTAN_SAMPLER_PREMAXIMA=$pm CAPSTAN_SAMPLER_MASSES=$ms python3 benchmarks/throughput.py --shape llama-3.2-1b \
        --workload mixed $greedy --requests 256 --prompt-len 256 --output-len 256 --max-num-seqs 256 \
        --max-num-batched-tokens 2048 --smallest-bucket 256 --timeline --json "$OUT/mixed$greedy-$pm-$ms.json" 2>&1 \
        | grep --line-buffered -E "output_tokens|phase|timeline|compiles|Error"; done ;;
esac; done
