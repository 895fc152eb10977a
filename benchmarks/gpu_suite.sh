#!/usr/bin/env bash
# One call on a lent GPU (see benchmarks/RESULTS.md): golden parity, bf16 prefill, throughput vs transformers.
# Run from the repo root with the haliax wheels in .whl/ (`make gpu-wheels` here, then carry .whl):
#   bash benchmarks/gpu_suite.sh [parity pagesize warmuptests asyncsched asyncpenalty hostprofile roofline drycost samplertests kernels prefill throughput decodetrace sampledtrace layertrace fused onestream hlodump gemv gemvsweep gemvmgpu gemvstep xlaflags throughput8b onestreampeer quant kernelsweep specpeaked spec8b fp8profile profile peer peer8b structured grammar sampling sampler apitests speculative speculative32 tp tp70b tptrace serve dp multiturn tierpreempt tiercalls copyoverlap hosttransfer lora loragather loratrace lorafold loraslots lorahlo loraqkv lorafoldlayers loraserve lorapeft fp8kvparity fp8kvspeed fp8kv8b fp8kvcap fp8kvmixed (fp8kv: all five) pagewrites allreduce tpprocs hoststep]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# everything this script prints also goes to $OUT/gpu_suite.log as it is printed: a call cut at its limit brings
# $OUT back, where its output piped through tail would be lost whole (the fiftieth session's first call)
exec > >(tee -a "$OUT/gpu_suite.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/site/capstan && ln -sfn "$PWD/capstan/__init__.py" /tmp/site/capstan/__init__.py
ln -sfn "$PWD/runtime" /tmp/site/capstan/runtime && ln -sfn "$PWD/operator" /tmp/site/capstan/operator
# PYTHONSAFEPATH: the repository's own capstan/ folder (no runtime inside) must not shadow the assembled package
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
parts=${*:-parity prefill throughput throughput8b peer}
expanded=""; for p in $parts; do [ "$p" = fp8kv ] && p="fp8kvparity fp8kvspeed fp8kv8b fp8kvcap fp8kvmixed"; expanded="$expanded $p"; done
parts=$expanded
for part in $parts; do
  echo "=== $part"
  # a part's timings are its own only on an idle machine: another process on the GPU, or a busy host, is named here
  others=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader)
  [ -n "$others" ] && echo "WARNING: the GPU is in use already: $others"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  case $part in
    apitests) python3 -m pytest -q -p no:cacheprovider tests/test_structured_outputs.py tests/test_offline_api.py 2>&1 | grep --line-buffered -E "passed|failed|FAILED|Error" | tail -30 ;;
    # float32: a verify chunk rounds as a decode step does, so greedy outputs stay identical (the machinery's bound)
    speculative32) python3 benchmarks/speculative.py --shape llama-3.2-1b --dtype float32 --batch-sizes 1 --tokens 64 \
        --smallest-bucket 64 --methods oracle draft-target 2>&1 | grep --line-buffered -v Warning ;;
    # bf16 with peaked output rows (clear margins, as a trained model's confident tokens): the machinery's bound
    # without float32's compile times; each method's steps split into build / draft / call / fetch / host
    specpeaked) python3 benchmarks/speculative.py --shape llama-3.2-1b --peaked 8 --timeline --batch-sizes ${SPEC_BATCHES:-1 8 64} \
        --tokens 128 --smallest-bucket 16 --methods ngram oracle draft-target 2>&1 | grep --line-buffered -v Warning ;;
    speculative) python3 benchmarks/speculative.py --shape llama-3.2-1b --batch-sizes 1 8 64 --tokens 128 \
        --smallest-bucket 64 --methods ngram oracle draft-target 2>&1 | grep --line-buffered -v Warning
      # the 8B shape with a 1B-shaped draft of its vocabulary (random weights: the cost of a draft, not its gain)
      python3 benchmarks/speculative.py --shape llama-3-8b --batch-sizes 1 8 --tokens 64 --smallest-bucket 64 2>&1 \
        | grep --line-buffered -v Warning ;;
    # issue 63: serve's background warm-up on the GPU (same tokens as a full warm-up, nothing compiled on a request's path)
    warmuptests) python3 -m pytest -q -p no:cacheprovider tests/test_warmup.py 2>&1 | grep --line-buffered -E "passed|failed|FAILED|Error|assert" | tail -30 ;;
    samplertests) python3 -m pytest -q -p no:cacheprovider tests/test_sampler.py tests/test_sampler_filters.py 2>&1 \
        | grep --line-buffered -E "passed|failed|FAILED|Error" | tail -30 ;;
    parity) python3 -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_models.py tests/test_engine_golden.py tests/test_rope_and_compat.py 2>&1 | grep --line-buffered -E "passed|failed|FAILED|Error" | tail -30 ;;
    prefill) python3 benchmarks/prefill.py --shape llama-3.2-1b --tokens 2048 ;;
    # issue 64: every throughput.py report this call wrote ($OUT/capstan-*.json: run throughput and throughput8b
    # first) against the GPU's measured copy bandwidth and bf16 matmul rate (benchmarks/roofline.py)
    roofline) python3 benchmarks/roofline.py $(for f in "$OUT"/capstan-*.json; do [ -e "$f" ] && echo "--report $f"; done) \
        2>&1 | grep --line-buffered -v Warning ;;
    throughput) python3 benchmarks/throughput.py --shape llama-3.2-1b --requests 256 --prompt-len 256 --output-len 256 \
        --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 --single-stream-tokens 256 --timeline \
        --json "$OUT/capstan-llama-3.2-1b.json" 2>&1 | grep --line-buffered -v Warning ;;
    # issue 64: asynchronous scheduling against synchronous, alternating (a compilation cache shared by the runs), with
    # the tokens' digest of each; then its tests on the GPU
    asyncsched) for f in --async-scheduling --no-async-scheduling --async-scheduling --no-async-scheduling; do echo "== $f"
        JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 python3 benchmarks/throughput.py \
          --shape llama-3.2-1b --requests 256 --prompt-len 256 --output-len 256 --max-num-seqs 256 \
          --max-num-batched-tokens 2048 --smallest-bucket 256 --timeline --digest $f 2>&1 \
          | grep --line-buffered -E "output_tokens_per_s|phase_s|timeline|digest|compile_s|Error"; done
      python3 -m pytest -q -p no:cacheprovider tests/test_async_scheduling.py 2>&1 | grep --line-buffered -E "passed|failed|Error" ;;
    # issue 64, item 2: the mixed workload with a repetition penalty on every request (Qwen2.5's own default, 1.05)
    # queued asynchronously (the default off CPU) and synchronously, beside the same requests all greedy
    asyncpenalty) for run in "--all-greedy" "--sampling={\"repetition_penalty\":1.05}" \
          "--sampling={\"repetition_penalty\":1.05} --no-async-scheduling"; do echo "== $run"
        JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 python3 benchmarks/throughput.py \
          --shape llama-3.2-1b --workload mixed --requests 256 --prompt-len 256 --output-len 256 --max-num-seqs 256 \
          --max-num-batched-tokens 2048 --smallest-bucket 256 --timeline $run 2>&1 \
          | grep --line-buffered -E "output_tokens_per_s|phase_s|timeline|compile_s|Error"; done ;;
    # the headline with the prefill phase's host under cProfile (a forty-ninth session's H100 call: 23 ms of host
    # work a prefill step outside build, call and fetch, against ~3 before): where it goes (asyncsched's cache)
    hostprofile) JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 python3 benchmarks/throughput.py --shape llama-3.2-1b --requests 256 --prompt-len 256 --output-len 256 \
        --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 --timeline --host-profile 30 2>&1 \
        | grep --line-buffered -v Warning | grep -v '^ *$' | head -120 ;;
    # the headline run again, with a Perfetto trace of one decode-phase engine step: device busy time against its span
    decodetrace) rm -rf /tmp/decodetrace; python3 benchmarks/throughput.py --shape llama-3.2-1b --requests 256 --prompt-len 256 --output-len 256 \
        --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 --trace /tmp/decodetrace 2>&1 \
        | grep --line-buffered -E "output_tokens_per_s|Error"; python3 benchmarks/trace_summary.py /tmp/decodetrace --top 25 ;;
    # the mixed workload's sampled run with a trace of one decode-phase step: what the sampler costs inside the scan
    sampledtrace) rm -rf /tmp/sampledtrace; python3 benchmarks/throughput.py --shape llama-3.2-1b --workload mixed \
        --requests 256 --prompt-len 256 --output-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 \
        --smallest-bucket 256 --trace /tmp/sampledtrace 2>&1 | grep --line-buffered -E "output_tokens_per_s|Error"
      python3 benchmarks/trace_summary.py /tmp/sampledtrace --top 30 ;;
    throughput8b) python3 benchmarks/throughput.py --shape llama-3-8b --requests 1 --prompt-len 256 --output-len 16 \
        --max-num-seqs 1 --max-num-batched-tokens 256 --smallest-bucket 256 --single-stream-tokens 256 \
        --json "$OUT/capstan-llama-3-8b.json" 2>&1 | grep --line-buffered -v Warning ;;
    # issue 64, item 3: one stream, greedy and sampled (top-p 0.95 at T 1), beside gpt-fast (torch.compile, CUDA graphs)
    # in the same call; carry .peer (a gpt-fast checkout at .peer/gpt-fast: benchmarks/peer_gpt_fast.py); FP8 weights
    # with ONESTREAM_ARGS="--quantization fp8"
    onestreampeer) for shape in ${ONESTREAM_SHAPES:-llama-3.2-1b llama-3-8b}; do echo "--- $shape"
        python3 benchmarks/throughput.py --shape $shape --requests 1 --prompt-len 256 --output-len 16 --max-num-seqs 1 \
          --max-num-batched-tokens 256 --smallest-bucket 256 --single-stream-tokens 256 --single-stream-top-p 0.95 \
          ${ONESTREAM_ARGS:-} --json "$OUT/onestream-$shape.json" 2>&1 | grep --line-buffered -E "single_stream|Error"
        python3 benchmarks/peer_gpt_fast.py --gpt-fast .peer/gpt-fast --shape $shape 2>&1 \
          | grep --line-buffered -E "^device|^gpt-fast|Error|error"; done ;;
    # Llama-3-8B shape, bf16 vs FP8 vs INT8 vs GGUF Q8_0 blocks: one stream (ms/token) and a batch of 64 (tokens/s)
    quant) for q in ${QUANTS:-none fp8 int8 q8_0}; do flag=$([ $q = none ] || echo "--quantization $q"); echo "--- $q"
        python3 benchmarks/throughput.py --shape llama-3-8b $flag --requests 64 --prompt-len 256 --output-len 128 \
          --max-num-seqs 64 --max-num-batched-tokens 1024 --smallest-bucket 64 --single-stream-tokens 256 \
          --json "$OUT/quant-llama-3-8b-$q.json" 2>&1 | grep --line-buffered -E "output_tokens|single_stream|compile|Error"; done ;;
    # issue 16 on two GPUs of one host (nvidia-h200-x2): Llama-3-8B shape, TP=1 vs TP=2, batch and one stream
    # issue 33: multi-turn conversations (prompts to 3.7k tokens), working set ~4x the device KV pool, with and without
    # the host-memory tier in one run; then single prefixes recomputed against copied back (the break-even length)
    # recompute, host tier and a pool that evicts nothing (the answers' reference); the 8B shape with half the
    # conversations and turns in flight (the same 4x working set / pool) to stay within a few minutes
    multiturn) for shape in ${MULTITURN_SHAPES:-llama-3.2-1b llama-3-8b}; do echo "--- $shape"
        case $shape in llama-3-8b) size="--conversations 32 --concurrency 8" ;; *) size="--conversations 64 --concurrency 16" ;; esac
        python3 benchmarks/multiturn.py --shape $shape $size --turns 5 --first-len 2048 --user-len 256 \
          --output-len 128 --max-num-seqs 32 --max-num-batched-tokens 2048 --smallest-bucket 256 \
          --break-even 128 512 2048 ${MULTITURN_ARGS:-} --json "$OUT/multiturn-$shape.json" 2>&1 | grep --line-buffered -v Warning; done ;;
    # issue 33: whether the tier pays for preemption: a pool of half the pages the batch needs, with no prefix cache,
    # with it (a preempted sequence's pages, until evicted), and with the tier (evicted ones back from host memory);
    # same greedy tokens (tokens_digest) in all three; then the tier again with loads that leave a free page per
    # running sequence (CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM=1)
    tierpreempt) for t in "" "--prefix-caching" "--kv-offloading-size ${TIERPREEMPT_GIB:-8}" "headroom"; do echo "--- ${t:-no prefix cache}"
        h=0; [ "$t" = headroom ] && h=1 t="--kv-offloading-size ${TIERPREEMPT_GIB:-8}"
        CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM=$h python3 benchmarks/throughput.py --shape llama-3.2-1b --requests 256 --prompt-len 512 --output-len 512 \
          --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 --num-pages ${TIERPREEMPT_PAGES:-8192} \
          --digest $t 2>&1 | grep --line-buffered -E "output_tokens|phase_s|preempt|hit_tokens|bytes_to|digest|compile|Error"; done ;;
    # issue 33: the engine thread's host time for the tier's calls (device_put, gathers, scatters), 1B and 8B
    tiercalls) for shape in ${TIERCALLS_SHAPES:-llama-3.2-1b llama-3-8b}; do python3 benchmarks/tier_calls.py --shape $shape \
        2>&1 | grep --line-buffered -v Warning; done ;;
    # issue 33: whether a copy to the device overlaps compute: started beside a program (it waits for the programs
    # queued before it), then made inside one program, layer by layer (with and without the latency-hiding scheduler)
    copyoverlap) python3 benchmarks/copy_overlap.py --mib 1024 --chunk-mib 32 --busy-ms 100 2>&1 | grep -v Warning
      for f in "" "--xla_gpu_enable_latency_hiding_scheduler=true"; do echo "--- XLA_FLAGS=[$f]"
        XLA_FLAGS="$f" python3 benchmarks/copy_in_program.py --layers 32 --chunk-mib 32 2>&1 | grep -v Warning; done ;;
    # issue 33: K/V pages host <-> device by each way JAX offers (numpy, pinned_host memory), 1B and 8B page sizes
    hosttransfer) for shape in llama-3.2-1b llama-3-8b; do python3 benchmarks/host_transfer.py --shape $shape --pages 8 64 256 \
        2>&1 | grep --line-buffered -v Warning; done ;;
    # TP_ARGS="--workload mixed" (sampled) or "--workload mixed --all-greedy": issue 31's held-out workloads
    tp) for n in ${TP_SIZES:-1 2}; do echo "--- tensor parallel $n ${TP_ARGS:-}"
        python3 benchmarks/throughput.py --shape llama-3-8b --tensor-parallel-size $n --requests 256 --prompt-len 256 \
          --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 ${TP_ARGS:-} \
          --single-stream-tokens 128 --json "$OUT/tp$n-llama-3-8b.json" 2>&1 \
          | grep --line-buffered -E "output_tokens|single_stream|compile|phase_s|timeline|Error"; done ;;
    # issue 31: TP=2 in one process driving both GPUs (the engine's way) and in two lockstep processes of one GPU
    # each (vLLM's way), each TP_PROCESSES entry (a count of processes) in turn
    tpprocs) for p in ${TP_PROCESSES:-1 2}; do echo "--- tensor parallel 2, $p process(es) ${TP_ARGS:-}"
        python3 benchmarks/throughput.py --shape llama-3-8b --tensor-parallel-size 2 --processes $p --requests 256 \
          --prompt-len 256 --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 \
          ${TP_ARGS:-} --single-stream-tokens 128 --json "$OUT/tp2-procs$p-llama-3-8b.json" 2>&1 \
          | grep --line-buffered -E "output_tokens|single_stream|compile|phase_s|timeline|processes|Error"; done ;;
    # issue 31: the all-reduce alone (benchmarks/all_reduce.py), one run for each XLA_FLAGS in ALLREDUCE_FLAGS
    # (a quoted list; '' for XLA's defaults), each NCCL_PROTO in ALLREDUCE_PROTOS (- for NCCL's choice) and each
    # count of processes in ALLREDUCE_PROCESSES (1: one process drives the GPUs, as the engine does; 2: one each)
    allreduce) eval "set -- ${ALLREDUCE_FLAGS:-''}"; for f in "$@"; do for proto in ${ALLREDUCE_PROTOS:--}; do
        for procs in ${ALLREDUCE_PROCESSES:-1}; do
        if [ "$proto" = - ]; then unset NCCL_PROTO; else export NCCL_PROTO=$proto; fi
        XLA_FLAGS="$f" python3 benchmarks/all_reduce.py --devices ${ALLREDUCE_DEVICES:-2} --processes $procs 2>&1 \
          | grep --line-buffered -v -E "Warning|Gloo"; done; done; done; unset NCCL_PROTO ;;
    # the host's share of a single step (scheduling, building, applying) on this machine's CPU, the inputs put on
    # its GPU; the 8B vocabulary
    hoststep) python3 benchmarks/host_step.py --vocab 128256 2>&1 | grep --line-buffered -v Warning ;;
    # issue 31: the Llama-3-70B shape (random bf16 weights made in parts on the mesh) at TP=4; one token bucket
    # (2048) keeps its 80 unrolled layers' compile short
    tp70b) python3 benchmarks/throughput.py --shape llama-3-70b --tensor-parallel-size ${TP70_SIZE:-4} --requests 256 \
          --prompt-len 256 --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 2048 \
          --single-stream-tokens 64 --json "$OUT/tp4-llama-3-70b.json" 2>&1 \
          | grep --line-buffered -E "output_tokens|single_stream|compile|phase_s|weights_init|Error"
        nvidia-smi --query-gpu=memory.used --format=csv,noheader ;;
    # issue 31: one decode-phase engine step traced at each TP size (256 rows and one stream), per GPU; the
    # collectives XLA put in the TP=2 steps' optimized HLO; TP_TRACE_STEP=6 TP_ROWS=256 NO_HLO=1: a prefill step;
    # GAPS=N: where each GPU idles (trace_summary.py --gaps); TP_TRACE_KEEP=1: the traces come back in $OUT
    tptrace) for n in ${TP_SIZES:-1 2}; do for rows in ${TP_ROWS:-256 1}; do echo "--- tensor parallel $n, $rows rows"; rm -rf /tmp/tpt
        hlo=$([ $n = 2 ] && [ $rows = 256 ] && [ -z "${NO_HLO:-}" ] && echo "--xla_dump_to=/tmp/tphlo --xla_dump_hlo_as_text")
        env ${hlo:+XLA_FLAGS="$hlo"} python3 benchmarks/throughput.py --shape llama-3-8b --tensor-parallel-size $n \
          --requests $rows --prompt-len 256 --output-len 128 --max-num-seqs $rows --max-num-batched-tokens 2048 \
          --smallest-bucket 256 --trace /tmp/tpt ${TP_TRACE_STEP:+--trace-step $TP_TRACE_STEP} 2>&1 \
          | grep --line-buffered -E "output_tokens_per_s|Error|error"
        python3 benchmarks/trace_summary.py /tmp/tpt --top ${TOP:-25} ${GAPS:+--gaps $GAPS}
        [ -n "${TP_TRACE_KEEP:-}" ] && find /tmp/tpt -name "*.trace.json.gz" -exec cp {} "$OUT/tp$n-rows$rows.trace.json.gz" \; ; done; done
      [ -d /tmp/tphlo ] && python3 benchmarks/hlo_collectives.py /tmp/tphlo --top 4 ;;
    # issue 32: 256 requests over 8 rank-16 adapters (q/k/v/o/gate/up/down) against the base in one process, and
    # one stream with and without an adapter (targets: >= 0.8x the base's tokens/s; one stream within 15%)
    lora) python3 benchmarks/lora.py --shape llama-3.2-1b --requests 256 --prompt-len 256 --output-len 256 \
        --adapters 8 --rank 16 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 \
        --single-stream-tokens 256 --json "$OUT/lora-llama-3.2-1b.json" 2>&1 | grep --line-buffered -v Warning ;;
    # one stream's kernels, base engine against one adapter (what the adapter's deltas launch, and their time)
    loratrace) python3 benchmarks/lora.py --shape llama-3.2-1b --no-batch --adapters 8 --rank 16 --trace /tmp/loratrace 2>&1 \
        | grep --line-buffered -E "single|Error"
      for kind in base lora; do echo "--- $kind"; python3 benchmarks/trace_summary.py /tmp/loratrace/$kind --top 45; done ;;
    # one stream with each CAPSTAN_LORA_FOLD (the shrinks read by the base weights' own matmuls; "-": none)
    lorafold) for fold in ${LORA_FOLDS:-- qkv,out gate_up,down all}; do echo "== CAPSTAN_LORA_FOLD=$fold"
        CAPSTAN_LORA_FOLD=${fold#-} python3 benchmarks/lora.py --shape llama-3.2-1b --no-batch --adapters 8 --rank 16 \
          --trace /tmp/lorafold-$fold --json "$OUT/lora-fold-$fold.json" 2>&1 | grep --line-buffered -E "single|Error"
        python3 benchmarks/trace_summary.py /tmp/lorafold-$fold/lora --top ${LORA_TOP:-30} | head -${LORA_TOP:-30}; done ;;
    # one stream's optimized HLO and one layer's kernel sequence, base engine and LoRA engine (default ways)
    lorahlo) XLA_FLAGS="--xla_dump_to=/tmp/lorahlo --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$ --xla_dump_hlo_module_re=.*decode.*" \
        python3 benchmarks/lora.py --shape llama-3.2-1b --no-batch --adapters 8 --rank 16 --single-stream-tokens 64 \
        --trace /tmp/lorahlotrace 2>&1 | grep --line-buffered -E "single|Error"
      mkdir -p "$OUT/hlo"; ls -S /tmp/lorahlo/*after_optimizations.txt | head -4 | while read -r f; do gzip -c "$f" > "$OUT/hlo/$(basename "$f").gz"; done
      for kind in base lora; do echo "--- $kind"; python3 benchmarks/trace_summary.py /tmp/lorahlotrace/$kind --sequence ${LORA_SEQ:-60}; done ;;
    # the q/k/v delta inside the fused decode kernel: its test compiled by Triton, then one stream by
    # LORA_QKV="IN_KERNEL:FOLD ..." (CAPSTAN_LORA_QKV_IN_KERNEL, CAPSTAN_LORA_FOLD; "-": none), one layer's kernels each
    loraqkv) python3 -m pytest -q -p no:cacheprovider tests/test_attention.py -k "adapter_delta" 2>&1 \
        | grep --line-buffered -E "passed|failed|FAILED|Error" | tail -10
      for v in ${LORA_QKV:-0:- 1:- 1:gate_up}; do IFS=: read -r inkernel fold <<< "$v"
        echo "== CAPSTAN_LORA_QKV_IN_KERNEL=$inkernel CAPSTAN_LORA_FOLD=$fold"
        CAPSTAN_LORA_QKV_IN_KERNEL=$inkernel CAPSTAN_LORA_FOLD=${fold#-} python3 benchmarks/lora.py --shape llama-3.2-1b \
          --no-batch --adapters 8 --rank 16 --trace /tmp/loraqkv-$inkernel-$fold 2>&1 | grep --line-buffered -E "single|Error"
        python3 benchmarks/trace_summary.py /tmp/loraqkv-$inkernel-$fold/lora --top 0 --sequence ${LORA_SEQ:-22} | grep -v "^ *[0-9.]* ms"; done ;;
    # issue 32: the shrink folded into a weight stored with the slots' A rows, against the step's concatenation and
    # the separate shrink, on the 1B shape's linear layers alone
    lorafoldlayers) python3 benchmarks/lora_fold_layers.py --shape llama-3.2-1b --slots 1 8 --rank 16 2>&1 | grep -v Warning ;;
    # issue 32 through HTTP: `capstan serve` with one rank-16 adapter (--max-loras 1), one stream on the base model
    # and on the adapter, then the offline engine on the same flags; small loads (the batch figures are lora's)
    loraserve) python3 benchmarks/online.py --shape llama-3.2-1b --lora-rank 16 --requests 16 --prompt-len 256 \
        --output-len 64 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 --max-model-len 2048 \
        --single-stream-tokens 256 --client-processes 1 --workloads '' --json "$OUT/online-lora-llama-3.2-1b.json" 2>&1 \
        | grep --line-buffered -v Warning ;;
    # one stream by device slots and fold (LORA_SLOTS="SLOTS:FOLD ...", FOLD "-" for none): --max-loras 1 is the default
    loraslots) for sf in ${LORA_SLOTS:-1:- 1:all 8:all}; do slots=${sf%%:*}; fold=${sf#*:}; echo "== --max-loras $slots CAPSTAN_LORA_FOLD=$fold"
        CAPSTAN_LORA_FOLD=${fold#-} python3 benchmarks/lora.py --shape llama-3.2-1b --no-batch --adapters 8 --rank 16 \
          --max-loras $slots --json "$OUT/lora-slots$slots-fold$fold.json" 2>&1 | grep --line-buffered -E "single|Error"; done ;;
    # one stream by each way models/lora.py has for a decode step: each token's own slot gathered and contracted as
    # products summed (XLA fuses them) or by einsum's matmuls, and every slot's rank space (the large steps' way)
    loragather) for way in products:16 einsum:16 products:0; do
        IFS=: read -r gway gmax <<< "$way"; echo "== CAPSTAN_LORA_GATHER_WAY:MAX_TOKENS=$way"
        CAPSTAN_LORA_GATHER_WAY=$gway CAPSTAN_LORA_GATHER_MAX_TOKENS=$gmax \
        python3 benchmarks/lora.py --shape llama-3.2-1b --no-batch --adapters 8 --rank 16 --single-stream-tokens 256 \
        --json "$OUT/lora-gather-$gway$gmax-llama-3.2-1b.json" 2>&1 | grep --line-buffered -v Warning; done ;;
    # issue 32: Capstan's LoRA engine against transformers' float32 logits of the merged checkpoints (and peft's own,
    # where installed), teacher-forced on Capstan's greedy tokens, for every golden checkpoint
    lorapeft) python3 benchmarks/lora_transformers_parity.py 2>&1 | grep --line-buffered -v Warning ;;
    kernels) python3 benchmarks/attention_kernels.py 2>&1 | grep --line-buffered -v Warning ;;
    # issue 31, FP8 K/V pages (--kv-cache-dtype fp8). Each part stays within one 10-minute call. parity: every kernel
    # compiled by Triton against the reference on FP8 pages, golden parity (teacher-forced through the ragged kernel,
    # and the engine) with the CPU's tolerances (-s prints the figures); the wrong-scale check is the CPU's alone
    fp8kvparity) python3 -m pytest -q -s -p no:cacheprovider tests/test_attention.py tests/test_fp8_kv_cache.py -k "fp8 and not wrong" \
        2>&1 | grep --line-buffered -E "fp8 pages|read with|passed|failed|FAILED|Error" | tail -40 ;;
    # the ragged and JAX's decode kernel timed on bf16 against FP8 pages; one decode step (the fused kernel) of the 8B
    # shape at 4k context, 1 and 32 rows (32 x 4k tokens fit bf16 pages at the default --kv-memory-fraction)
    fp8kvspeed) python3 benchmarks/attention_kernels.py --fp8 2>&1 | grep --line-buffered -v Warning
      for kv in auto fp8; do python3 benchmarks/decode_profile.py --shape llama-3-8b --kv-cache-dtype $kv --rows 1 32 \
        --context 4096 --quick 2>&1 | grep --line-buffered -E "rows=|Error"; done ;;
    # the 8B shape, 256 requests of 256 -> 128 (issue 31's TP workload): bf16 pages against FP8 pages, same call
    fp8kv8b) for kv in auto fp8; do echo "--- llama-3-8b --kv-cache-dtype $kv"
        python3 benchmarks/throughput.py --shape llama-3-8b --kv-cache-dtype $kv --requests 256 --prompt-len 256 \
          --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 \
          --json "$OUT/fp8kv-llama-3-8b-$kv.json" 2>&1 | grep --line-buffered -E "kv_|output_tokens|prefill_tokens|compile|Error"; done ;;
    # the most sequences of 4,096 tokens the pages hold at --kv-memory-fraction 0.6 (and reach decoding together), and
    # the output tokens/s there, 8B shape, bf16 against FP8 pages
    fp8kvcap) python3 benchmarks/kv_capacity.py --shape llama-3-8b --context 4096 --output-len 64 --kv-cache-dtypes auto fp8 \
        --max-num-seqs 256 --json "$OUT/fp8kv-capacity-llama-3-8b.json" 2>&1 | grep --line-buffered -v Warning ;;
    # Qwen3-0.6B against Llama-3.2-1B on the mixed workload (sampled), bf16 and FP8 pages (FP8MIXED_SHAPES, FP8MIXED_KV:
    # a part of them per call: the four runs take more than one call's 600 s)
    fp8kvmixed) for shape in ${FP8MIXED_SHAPES:-qwen3-0.6b llama-3.2-1b}; do for kv in ${FP8MIXED_KV:-auto fp8}; do echo "--- $shape mixed --kv-cache-dtype $kv"
        python3 benchmarks/throughput.py --shape $shape --workload mixed --kv-cache-dtype $kv --requests 256 --prompt-len 256 \
          --output-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 \
          --json "$OUT/fp8kv-mixed-$shape-$kv.json" 2>&1 | grep --line-buffered -E "kv_|output_tokens|compile|Error"; done; done ;;
    # a prefill step's K/V write into bf16 and FP8 pages: the engine's scatter against one of the bits
    pagewrites) python3 benchmarks/page_writes.py 2>&1 | grep --line-buffered -v Warning ;;
    kernelsweep) python3 benchmarks/attention_kernels.py --sweep 2>&1 | grep --line-buffered -v Warning ;;
    grammar) python3 benchmarks/grammar_mask.py 2>&1 | grep --line-buffered -v Warning ;;
    # SAMPLING_PEAKED="0 4": also with the LM head's rows of 512 tokens scaled by 4 (peaked rows, top-1 ~0.07-0.5 as a
    # trained model's: top-p decided among the candidates) beside random weights' flat rows (0, the default)
    sampling) for shape in ${SHAPES:-llama-3.2-1b qwen3-0.6b}; do for gain in ${SAMPLING_PEAKED:-0}; do
        for greedy in "" --all-greedy; do peak=$([ "$gain" = 0 ] || echo "-peaked$gain"); echo "--- $shape$peak mixed $greedy"
        python3 benchmarks/throughput.py --shape $shape --workload mixed $greedy --peaked $gain --requests 256 \
          --prompt-len 256 --output-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 \
          --timeline --json "$OUT/mixed-$shape$peak$greedy.json" 2>&1 | grep --line-buffered -E "output_tokens|phase|timeline|Error"; done; done; done ;;
    # issue 67: DRY's cost on the mixed workload (every request: the repetition penalty, then it and DRY 0.8)
    drycost) for fields in '{"repetition_penalty": 1.1}' '{"repetition_penalty": 1.1, "dry_multiplier": 0.8}'; do
        echo "--- llama-3.2-1b mixed --sampling '$fields'"
        python3 benchmarks/throughput.py --shape llama-3.2-1b --workload mixed --sampling "$fields" --requests 256 \
          --prompt-len 256 --output-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 \
          2>&1 | grep --line-buffered -E "output_tokens_per_s|compiles_in_run|Error"; done ;;
    sampler) python3 benchmarks/sampler.py --rows 256 --vocab 128256 --methods sort search15 candidates-fused kernels --repeats 10 \
        --breakdown 2>&1 | grep --line-buffered -v Warning ;;
    structured) for f in 0 0.5; do python3 benchmarks/throughput.py --shape llama-3.2-1b --requests 256 --prompt-len 256 \
        --output-len 256 --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 --constrained-fraction $f \
        --json "$OUT/structured-$f.json" 2>&1 | grep --line-buffered -E "output_tokens|seconds|phase|Error"; done ;;
    profile) python3 benchmarks/decode_profile.py --shape llama-3.2-1b --rows 1 256 --context 384 2>&1 | grep --line-buffered rows= ;;
    # one Llama-3.2-1B stream's decode step kernel by kernel, with one layer's chain in order (issue 14's 1.3 ms)
    layertrace) rm -rf /tmp/trace-1b; python3 benchmarks/decode_profile.py --shape llama-3.2-1b --rows 1 --context 384 \
        --trace /tmp/trace-1b 2>&1 | grep --line-buffered rows=; python3 benchmarks/trace_summary.py /tmp/trace-1b/rows1 --top 20 --sequence 40 ;;
    # issue 64: KV pages of 16 (the default), 32 and 64 tokens under the decode step (the fused kernel loads 4 pages a
    # block by default: 64, 128 or 256 keys; "w,s,p" PAGE_TUNINGS entries pin warps, stages and pages a block)
    pagesize) for ps in ${PAGE_SIZES:-16 32 64}; do for tuning in - ${PAGE_TUNINGS:-}; do echo "--- page $ps tuning $tuning"
        CAPSTAN_FUSED_DECODE_TUNING=${tuning#-} python3 benchmarks/decode_profile.py --shape ${PAGE_SHAPE:-llama-3.2-1b} \
          --rows ${PAGE_ROWS:-1 256} --context ${PAGE_CONTEXT:-384} --page-size $ps --quick 2>&1 | grep --line-buffered -E "rows=|Error"; done; done ;;
    # issue 14: norms, rope and the K/V write inside the decode kernel (gpu_fused_decode) against separate kernels
    fused) for shape in ${FUSED_SHAPES:-llama-3.2-1b llama-3-8b qwen3-0.6b}; do for fused in 1 0; do
        echo "--- CAPSTAN_FUSED_DECODE=$fused $shape"
        CAPSTAN_FUSED_DECODE=$fused python3 benchmarks/decode_profile.py --shape $shape --rows ${FUSED_ROWS:-1 256} \
          --context 384 --quick 2>&1 | grep --line-buffered -E "rows=|Error"; done; done ;;
    # issue 64: the decode step (ms, multi-step; one row and 256) under XLA fusion options the `onestream` part did not
    # try: more of the small kernels into Triton fusions, or the GEMMs' epilogues into cuDNN's. "|"-separated sets in
    # XLAFLAG_SETS; a set naming a flag this build's XLA does not know (XLA_FLAGS=--help) is skipped, not fatal
    xlaflags) known=$(XLA_FLAGS=--help python3 -c "import jax; jax.numpy.zeros(1)" 2>&1 | grep -oE -- '--xla_gpu[a-z0-9_]+' | sort -u)
      sets=${XLAFLAG_SETS:-"|--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true|--xla_gpu_experimental_enable_fusion_block_level_rewriter=true|--xla_gpu_cudnn_gemm_fusion_level=2|--xla_gpu_enable_dynamic_slice_fusion=true"}
      IFS='|' read -r -a flagsets <<< "$sets"
      for flags in "${flagsets[@]}"; do missing=""
        for f in $flags; do grep -qx -- "${f%%=*}" <<< "$known" || missing="$missing ${f%%=*}"; done
        [ -n "$missing" ] && { echo "--- XLA_FLAGS='$flags' skipped: unknown to this XLA:$missing"; continue; }
        for shape in ${XLAFLAG_SHAPES:-llama-3.2-1b}; do echo "--- $shape XLA_FLAGS='$flags'"
          XLA_FLAGS="$flags" python3 benchmarks/decode_profile.py --shape $shape --rows ${XLAFLAG_ROWS:-1 256} --context 384 \
            --quick 2>&1 | grep --line-buffered -E "rows=|Error"; done; done ;;
    # one stream's decode step (ms, multi-step) under XLA's GEMM and CUDA-graph options, and FP8's two small-batch paths
    onestream) for flags in "" "--xla_gpu_enable_triton_gemm=false" \
          "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"; do
        for shape in llama-3.2-1b llama-3-8b; do echo "--- $shape XLA_FLAGS='$flags'"
          XLA_FLAGS="$flags" python3 benchmarks/decode_profile.py --shape $shape --rows 1 --context 384 --quick 2>&1 | grep --line-buffered rows=; done; done
      for rows in 0 8; do echo "--- llama-3-8b fp8, weight-only at <= $rows rows"
        CAPSTAN_FP8_WEIGHT_ONLY_MAX_ROWS=$rows python3 benchmarks/decode_profile.py --shape llama-3-8b --quantization fp8 \
          --rows 1 --context 384 --quick 2>&1 | grep --line-buffered rows=; done ;;
    # one stream's linear layers: the GEMV kernel compiled by Triton against numpy, then timed against XLA's dot
    gemv) python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gemv.py 2>&1 | grep --line-buffered -E "passed|failed|FAILED|Error" | tail -30
      python3 benchmarks/gemv.py --shapes llama-3.2-1b llama-3-8b --weights ${WEIGHTS:-bf16 fp8 int8 q8_0} 2>&1 | grep --line-buffered -v Warning ;;
    # issue 64, item 3: does TMA streaming (JAX's own Pallas Mosaic GPU Hopper matmul, one row padded to 64) read one
    # stream's weights faster than XLA's Triton GEMV? Where it does, a split-K kernel of that kind is worth writing
    gemvmgpu) python3 benchmarks/gemv.py --shapes ${SHAPES:-llama-3.2-1b llama-3-8b} --weights bf16 --mgpu 2>&1 \
        | grep --line-buffered -v Warning ;;
    gemvsweep) python3 benchmarks/gemv.py --shapes ${SHAPES:-llama-3.2-1b llama-3-8b} --weights ${WEIGHTS:-bf16 fp8} --sweep 2>&1 \
        | grep --line-buffered -v Warning ;;
    # one stream's whole decode step (ms, multi-step) with the GEMV kernel on every weight and with XLA's dots
    gemvstep) for spec in ${STEP_MODELS:-llama-3.2-1b llama-3-8b llama-3-8b:fp8 llama-3-8b:int8}; do for gemv in 1 0; do
        shape=${spec%%:*}; q=$([ "$shape" = "$spec" ] || echo "--quantization ${spec#*:}"); echo "--- CAPSTAN_GEMV=$gemv $shape $q"
        CAPSTAN_GEMV=$gemv python3 benchmarks/decode_profile.py --shape $shape $q --rows ${STEP_ROWS:-1} --context 384 --quick 2>&1 \
          | grep --line-buffered -E "rows=|Error"; done; done ;;
    # the optimized HLO of one Llama-3.2-1B stream's multi-step decode, to name the trace's fusions (into $OUT/hlo)
    hlodump) XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" python3 \
        benchmarks/decode_profile.py --shape llama-3.2-1b --rows 1 --context 384 --quick 2>&1 | grep --line-buffered rows=
      mkdir -p "$OUT/hlo"; f=$(ls -S /tmp/hlo/*after_optimizations.txt | head -1); echo "$f"; gzip -c "$f" > "$OUT/hlo/decode.txt.gz" ;;
    # issue 15's FP8 goal: where one Llama-3-8B FP8 stream's step goes (bf16 for comparison), kernels from the trace
    fp8profile) for q in bf16 fp8; do flag=$([ $q = bf16 ] || echo "--quantization $q"); rm -rf /tmp/trace-$q
        python3 benchmarks/decode_profile.py --shape llama-3-8b $flag --rows 1 --context 384 --trace /tmp/trace-$q 2>&1 \
          | grep --line-buffered rows=; python3 benchmarks/trace_summary.py /tmp/trace-$q/rows1 --top 15 --sequence 30; done ;;
    # issue 15's case (c): the 8B shape with a 1B-shaped draft, and n-gram, per step (batch 1 and 8)
    spec8b) python3 benchmarks/speculative.py --shape llama-3-8b --peaked 8 --timeline --batch-sizes ${SPEC_BATCHES:-1 8} --tokens 64 \
        --smallest-bucket ${SPEC_BUCKET:-16} --methods ${SPEC_METHODS:-ngram oracle draft-small} 2>&1 | grep --line-buffered -v Warning ;;
    # issue 28: capstan serve (engine core process, HTTP frontends) against LLMEngine with the same flags on one random
    # 1B checkpoint: 256 streams of 256 -> 256 token ids from 4 and 8 client processes (the client is no bottleneck
    # when they agree; 1 and 2 were: 19.4k and 31.8k tok/s), not streamed, one stream, serve.py's five workloads;
    # offline with detokenize on and off. API_SERVERS=N: --api-server-count (default auto); SERVE_ARGS: more flags, both sides;
    # SERVE_REQUESTS, SERVE_CLIENTS: requests and client processes; ONLINE_ARGS: more flags of online.py
    serve) python3 benchmarks/online.py --shape llama-3.2-1b --requests ${SERVE_REQUESTS:-256} --prompt-len 256 --output-len 256 \
        --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 --max-model-len 2048 \
        --single-stream-tokens 256 --client-processes ${SERVE_CLIENTS:-4 8} --api-server-count ${API_SERVERS:-auto} ${SERVE_ARGS:+--server-args="$SERVE_ARGS"} ${ONLINE_ARGS:-} \
        --json "$OUT/online-llama-3.2-1b.json" 2>&1 | grep --line-buffered -v Warning
      cp /tmp/capstan-online-server-*.log "$OUT/" 2>/dev/null ;;
    # issue 31: --data-parallel-size through the server, each run "DP:API_SERVERS:CLIENT_PROCESSES" (DP_RUNS), the
    # same DP_REQUESTS requests of 256 -> 256 token ids; each load prints the server's CPU by role, the host's busy
    # cores and each GPU's busy share (benchmarks/proc_usage.py)
    dp) for run in ${DP_RUNS:-1:6:8 2:12:16}; do IFS=: read -r dp apis clients <<< "$run"; echo "--- DP=$dp, $apis frontends, $clients client processes"
        python3 benchmarks/online.py --shape llama-3.2-1b --requests ${DP_REQUESTS:-2048} --prompt-len 256 --output-len 256 \
          --max-num-seqs 256 --max-num-batched-tokens 2048 --smallest-bucket 256 --max-model-len 2048 --single-stream-tokens 0 \
          --client-processes $clients --api-server-count $apis --phases online --workloads '' \
          --server-args="--data-parallel-size $dp ${DP_ARGS:-}" --json "$OUT/dp-$dp-$apis-$clients.json" 2>&1 \
          | grep --line-buffered -v Warning; done ;;
    peer) python3 benchmarks/peer_transformers.py --shape llama-3.2-1b --requests 256 --prompt-len 256 --output-len 256 \
        --single-tokens 256 --json "$OUT/transformers-llama-3.2-1b.json" 2>&1 | grep --line-buffered -v Warning | tail -25 ;;
    peer8b) python3 benchmarks/peer_transformers.py --shape llama-3-8b --phases single --single-tokens 256 \
        --json "$OUT/transformers-llama-3-8b.json" 2>&1 | grep --line-buffered -v Warning | tail -8 ;;
  esac
done
