#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md's serving, family and MoE tables, in parts that each fit a 10-minute
# call on one GPU (an H200 for the published tables). Run from the repository root:
#
#   bash benchmarks/gpu_run.sh tests      # the GPU test suite (pytest -m gpu), one process per file; TEST_SHARD=i/n
#                                         # runs the i-th of n shares (gpu_side_by_side.sh spreads them over GPUs);
#                                         # TEST_FILES="tests/a.py tests/b.py" runs those files instead of all
#   bash benchmarks/gpu_run.sh engine     # the batching engine on Llama-3-8B: single, fixed, mixed (+ transformers), prefix
#   bash benchmarks/gpu_run.sh engine-eager  # fixed, mixed and prefix again with eager prefill steps
#   bash benchmarks/gpu_run.sh families   # batch-1 decode of the new families in bf16 and int4
#   bash benchmarks/gpu_run.sh moe        # the MoE GPU tests, batch-1 decode of the MoE models in bf16, int8 and int4,
#                                         # and the engine's mixed workload on Qwen3-30B-A3B
#   bash benchmarks/gpu_run.sh serve      # serve.py on random Llama-3-8B weights under bench_serve.py
#   bash benchmarks/gpu_run.sh serve-offline  # the same one-client and 64-stream requests through the engine alone
#   bash benchmarks/gpu_run.sh frontdoor  # serve.py started cold, then WARM_STARTS times (default 1) with its
#                                         # compile cache warm, each to /health 200; against the last 512 prompts
#                                         # of 128/128 at once, 64 streams of 512/256 and one client's 8 of 128/256
#   bash benchmarks/gpu_run.sh frontdoor-pair  # one start, 512 x 128/128 against it from CLIENTS (default 4)
#                                         # client processes, then the same requests through the engine in-process
#   bash benchmarks/gpu_run.sh frontdoor-offline  # the same 512 requests through the engine in-process, and the
#                                         # fixed workload at --max-running 256 and 512
#   bash benchmarks/gpu_run.sh hf-int4    # a random Llama-3-8B GPTQ g128 folder converted, batch 1 beside Redline's int4
#   bash benchmarks/gpu_run.sh vision     # the image tests, then time to first token of one 896 x 896 image on random
#                                         # Gemma-3-12B and Qwen2.5-VL-7B weights (preprocess, encoder, prefill apart),
#                                         # then 64 requests through the engine, half of them with a picture
#   bash benchmarks/gpu_run.sh serve-json # 64 streams of 512/256 without, then with, a JSON schema on every request
#   bash benchmarks/gpu_run.sh tp         # 2 GPUs: Llama-2-70B bf16 and int8 batch-1 decode at TP2, Llama-3-8B at TP2
#                                         # against one GPU, the all-reduce's share of a step, then the 2-GPU tests
#   bash benchmarks/gpu_run.sh fp8        # Llama-3-8B fixed 1,024 x 128/128 in bf16 then FP8, batch 1 bf16/int8/fp8
#   bash benchmarks/gpu_run.sh fp8-mixed  # the mixed workload in bf16 then FP8
#   bash benchmarks/gpu_run.sh tp-tests   # 2 GPUs: the tensor-parallel GPU tests alone
#   bash benchmarks/gpu_run.sh tp4        # 4 GPUs: Llama-2-70B bf16 and Llama-3.1-405B int4 g128 batch-1 decode at TP4
#   bash benchmarks/gpu_run.sh tp-serving # 2 GPUs: the engine at TP2 on Llama-3.1-70B bf16, fixed 1,024 x 128/128
#   bash benchmarks/gpu_run.sh tp-serve   # 2 GPUs: serve.py --tensor-parallel 2 on it under bench_serve.py, 256 x 128/128
#
# PORT moves the server parts off 8321 (8322 for tp-serve), so that parts can run side by side on one machine's
# GPUs (CUDA_VISIBLE_DEVICES and RESULTS apart). SERVE_MODEL and SERVE_VOCAB pick another registry model for the two serve parts (a smoke run on a small one), and
# SERVE_ARGS adds engine flags to both and to tp-serving and tp-serve (SERVE_ARGS=--no-compile-prefill).
# RESULTS (default benchmarks/results/gpu-run) receives every JSON, log and plot; the last line of each part prints
# where. REDLINE_GIT_COMMIT names the commit in every JSON where the copy's git metadata cannot (a copied tree). Wheels the GPU machine lacks (fastapi, uvicorn, starlette, pydantic, openai, ...) may be put in .whl/: they
# are installed into /tmp/site first.
set -uo pipefail
part=${1:?usage: bash benchmarks/gpu_run.sh tests|engine|engine-eager|fp8|fp8-mixed|tp4|tp-tests|families|moe|serve|serve-offline|serve-json|frontdoor|frontdoor-pair|frontdoor-offline|hf-int4|vision|tp|tp-serving|tp-serve}
model=${SERVE_MODEL:-Llama-3-8B}
vocab=${SERVE_VOCAB:-128256}
extra=${SERVE_ARGS:-}
RESULTS=${RESULTS:-benchmarks/results/gpu-run}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
# Python writes the bytecode of what it imports (in a writable folder), as an installed package has it: an image
# that sets PYTHONDONTWRITEBYTECODE over packages without .pyc files otherwise compiles torch's sources again in
# every process, seconds of each start.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/redline-pycache}
if [ -z "${WHEELS_INSTALLED:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Run from the checkout without an install: the package is the repository root under the name redline.
if ! python3 -c "import redline" 2>/dev/null; then
    mkdir -p /tmp/redline-pkg && ln -sfn "$PWD" /tmp/redline-pkg/redline
    export PYTHONPATH=/tmp/redline-pkg${PYTHONPATH:+:$PYTHONPATH}
fi
start_server() {  # start_server LOG ARGS...: serve.py on $port in the background ($server), back once /health is 200
    local log=$1; shift
    python3 serve.py --random-weights "$model" --dtype bfloat16 --port $port "$@" >"$log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
        kill -0 $server 2>/dev/null || { echo "serve.py exited; see $log"; exit 1; }
        sleep 0.5
    done
    echo "serve.py was not ready after 300 s; see $log"; exit 1
}
run() {  # run NAME COMMAND...: the command's output goes to RESULTS/NAME.log and to the terminal
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$RESULTS/$name.log"
}

case $part in
tests)
    # Each file with GPU tests in its own pytest process (one file's failure cannot leave the GPU full or a CUDA
    # context broken for the next); TEST_SHARD=i/n takes every n-th file from the i-th (0-based), so that n GPUs
    # share the suite. The summary lines are gathered at the end.
    shard=${TEST_SHARD:-0/1}
    files=${TEST_FILES:-$(grep -l -E "mark\.gpu|def test_gpu_" tests/test_*.py)}
    files=$(printf '%s\n' $files | awk -v s="$shard" 'BEGIN { split(s, a, "/") } (NR - 1) % a[2] == a[1]')
    for f in $files; do
        run "gpu-$(basename "$f" .py)" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "$f"
    done
    echo "== GPU test summary ($shard)"
    for f in $files; do
        echo "$(basename "$f"): $(grep -E "passed|failed|error|skipped|no tests ran" "$RESULTS/gpu-$(basename "$f" .py).log" | tail -1)"
    done | tee "$RESULTS/gpu-tests-summary.txt"
    ;;
engine)
    bench=benchmarks/bench_serving.py
    run engine-single python3 $bench --model Llama-3-8B --workload single --json "$RESULTS/engine-single.json"
    run engine-fixed python3 $bench --model Llama-3-8B --workload fixed --num-requests 1024 \
        --json "$RESULTS/engine-fixed.json"
    run engine-mixed python3 $bench --model Llama-3-8B --workload mixed --compare hf --hf-requests 32 \
        --json "$RESULTS/engine-mixed.json"
    run engine-prefix python3 $bench --model Llama-3-8B --workload prefix --json "$RESULTS/engine-prefix.json"
    run engine-prefix-graphs python3 $bench --model Llama-3-8B --workload prefix --prefill-graphs \
        --json "$RESULTS/engine-prefix-graphs.json"
    ;;
engine-eager)
    bench="benchmarks/bench_serving.py --model Llama-3-8B --no-compile-prefill"
    run engine-fixed-eager python3 $bench --workload fixed --num-requests 1024 --json "$RESULTS/engine-fixed-eager.json"
    run engine-mixed-eager python3 $bench --workload mixed --json "$RESULTS/engine-mixed-eager.json"
    run engine-prefix-eager python3 $bench --workload prefix --json "$RESULTS/engine-prefix-eager.json"
    ;;
families)
    for model in Qwen2.5-7B Qwen3-8B Gemma-3-12B Phi-4-mini; do
        run "decode-$model" python3 benchmarks/bench.py --model "$model" --quant none,int4 --runs 3 \
            --new-tokens 200 --json "$RESULTS/decode-$model.json"
    done
    ;;
moe)
    run moe-gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe.py tests/test_moe.py
    for model in Qwen3-30B-A3B Mixtral-8x7B; do
        run "decode-$model" python3 benchmarks/bench.py --model "$model" --quant none,int8,int4 --runs 3 \
            --new-tokens 200 --json "$RESULTS/decode-$model.json"
    done
    run engine-mixed-Qwen3-30B-A3B python3 benchmarks/bench_serving.py --model Qwen3-30B-A3B --workload mixed \
        --json "$RESULTS/engine-mixed-qwen3-30b-a3b.json"
    ;;
serve)
    port=${PORT:-8321}
    start_server "$RESULTS/server.log" $extra  # /health is 200 once the model is loaded and its graphs captured
    trap 'kill $server 2>/dev/null' EXIT
    url="--base-url http://127.0.0.1:$port"
    run serve-one python3 benchmarks/bench_serve.py $url --num-prompts 8 --max-concurrency 1 --input-len 128 \
        --output-len 256 --vocab-size "$vocab" --json "$RESULTS/serve-one.json"
    run serve-64 python3 benchmarks/bench_serve.py $url --num-prompts 64 --input-len 512 --output-len 256 \
        --vocab-size "$vocab" --json "$RESULTS/serve-64.json"
    # 300 prompts a rate keeps the sweep inside one call (at 2 requests/s their arrivals alone take 150 s).
    run serve-sweep python3 benchmarks/bench_serve.py $url --request-rate 2,8,32 --num-prompts 300 \
        --input-len 100:1024 --output-len 256 --vocab-size "$vocab" --json "$RESULTS/serve-sweep.json" \
        --plot "$RESULTS/serve-sweep.png"
    kill -TERM $server && wait $server
    ;;
serve-json)
    # Random weights need a tokenizer for grammars: one trained on this repository's text (no download).
    run bench-tokenizer python3 benchmarks/bench_tokenizer.py --out "$RESULTS/bench-tokenizer" --vocab-size 32000
    port=${PORT:-8321}
    python3 serve.py --random-weights "$model" --dtype bfloat16 --port $port --tokenizer "$RESULTS/bench-tokenizer" \
        $extra >"$RESULTS/server-json.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null' EXIT
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 $server 2>/dev/null || { echo "serve.py exited; see $RESULTS/server-json.log"; exit 1; }
        sleep 2
    done
    url="--base-url http://127.0.0.1:$port"
    # Prompt ids stay inside the trained tokenizer's vocabulary. A first run of the same shape compiles the schema's
    # grammar and captures the masked decode graphs its steps need (they are made on first use, not at start-up).
    run serve-json-warm python3 benchmarks/bench_serve.py $url --num-prompts 64 --input-len 512 --output-len 256 \
        --vocab-size 16000 --json-schema list
    run serve-json-plain python3 benchmarks/bench_serve.py $url --num-prompts 64 --input-len 512 --output-len 256 \
        --vocab-size 16000 --json "$RESULTS/serve-json-plain.json"
    run serve-json-schema python3 benchmarks/bench_serve.py $url --num-prompts 64 --input-len 512 --output-len 256 \
        --vocab-size 16000 --json-schema list --json "$RESULTS/serve-json-schema.json"
    grep -v "^INFO" "$RESULTS/server-json.log" | tail -15
    kill -TERM $server && wait $server
    ;;
frontdoor)
    port=${PORT:-8321}
    cache=${COMPILE_CACHE:-/tmp/redline-compile-cache}
    capture=${CAPTURE_TOKENS:-2048}
    warm_starts=${WARM_STARTS:-1}
    rm -rf "$cache"
    url="--base-url http://127.0.0.1:$port"
    last=warm$warm_starts
    for start in cold $(seq -f "warm%g" "$warm_starts"); do
        t0=$(date +%s.%N)
        start_server "$RESULTS/server-$start.log" --max-running 512 --capture-tokens "$capture" \
            --compile-cache "$cache" $extra
        echo "== start-$start: /health 200 after $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s"
        grep "redline" "$RESULTS/server-$start.log" | tail -4
        if [ $start = "$last" ]; then
            run serve-512 python3 benchmarks/bench_serve.py $url --num-prompts 512 --input-len 128 \
                --output-len 128 --vocab-size "$vocab" --clients "${CLIENTS:-1}" --json "$RESULTS/serve-512.json"
            run serve-64 python3 benchmarks/bench_serve.py $url --num-prompts 64 --input-len 512 \
                --output-len 256 --vocab-size "$vocab" --clients "${CLIENTS:-1}" --json "$RESULTS/serve-64.json"
            run serve-one python3 benchmarks/bench_serve.py $url --num-prompts 8 --max-concurrency 1 \
                --input-len 128 --output-len 256 --vocab-size "$vocab" --json "$RESULTS/serve-one.json"
        fi
        kill -TERM $server && wait $server
        echo "== start-$start: exit status $?"
    done
    ;;
frontdoor-pair)
    port=${PORT:-8321}
    cache=${COMPILE_CACHE:-/tmp/redline-compile-cache}
    capture=${CAPTURE_TOKENS:-2048}
    start_server "$RESULTS/server.log" --max-running 512 --capture-tokens "$capture" --compile-cache "$cache" $extra
    run serve-512 python3 benchmarks/bench_serve.py --base-url http://127.0.0.1:$port --num-prompts 512 \
        --input-len 128 --output-len 128 --vocab-size "$vocab" --clients "${CLIENTS:-4}" --json "$RESULTS/serve-512.json"
    kill -TERM $server && wait $server
    # The same compile cache as the server's, so the in-process engine compiles nothing new.
    TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton" run serve-512-offline \
        python3 benchmarks/bench_serve.py --offline --random-weights "$model" --dtype bfloat16 --vocab-size "$vocab" \
        --max-running 512 --capture-tokens "$capture" --num-prompts 512 --input-len 128 --output-len 128 $extra \
        --json "$RESULTS/serve-512-offline.json"
    ;;
frontdoor-offline)
    offline="--offline --random-weights $model --dtype bfloat16 --vocab-size $vocab --max-running 512"
    offline="$offline --capture-tokens ${CAPTURE_TOKENS:-2048} $extra"
    run serve-512-offline python3 benchmarks/bench_serve.py $offline --num-prompts 512 --input-len 128 \
        --output-len 128 --json "$RESULTS/serve-512-offline.json"
    bench=benchmarks/bench_serving.py
    for rows in 256 512; do
        run engine-fixed-$rows python3 $bench --model "$model" --workload fixed --num-requests 1024 \
            --max-running $rows --json "$RESULTS/engine-fixed-$rows.json"
    done
    ;;
serve-offline)
    offline="--offline --random-weights $model --dtype bfloat16 --vocab-size $vocab $extra"
    run serve-one-offline python3 benchmarks/bench_serve.py $offline --num-prompts 8 --max-concurrency 1 \
        --input-len 128 --output-len 256 --json "$RESULTS/serve-one-offline.json"
    run serve-64-offline python3 benchmarks/bench_serve.py $offline --num-prompts 64 --input-len 512 \
        --output-len 256 --json "$RESULTS/serve-64-offline.json"
    ;;
hf-int4)
    run hf-int4-decode python3 benchmarks/bench_hf_int4.py --model Llama-3-8B --groupsize 128 --runs 3
    ;;
vision)
    run vision-tests python3 -m pytest -q -p no:cacheprovider tests/test_vision.py tests/test_images.py \
        tests/test_engine_images.py
    run vision-ttft python3 benchmarks/bench_vision.py --model Gemma-3-12B --model Qwen2.5-VL-7B --image-size 896 \
        --repeats 10 --json "$RESULTS/vision-ttft.json"
    for model in Gemma-3-12B Qwen2.5-VL-7B; do
        run "vision-serve-$model" python3 benchmarks/bench_serve.py --offline --vision-model "$model" --device cuda \
            --dtype bfloat16 --image-share 0.5 --image-size 896 --num-prompts 64 --input-len 256 --output-len 128 \
            --json "$RESULTS/vision-serve-$model.json"
    done
    ;;
tp)
    # NVLink multicast stays off: NCCL's NVLS and symmetric memory's multicast objects are never used.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    [ "$gpus" -ge 2 ] || { echo "the tp part needs 2 GPUs; this machine has $gpus" >&2; exit 2; }
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
    # torch's launcher as a module (no torchrun script needed on the path); it passes PYTHONPATH on to the ranks.
    launch="python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29517"
    budget() {  # seconds left of one 10-minute call (at least 1: `timeout 0` would mean no limit)
        local left=$(( ${TP_SECONDS:-570} - SECONDS ))
        echo $(( left > 1 ? left : 1 ))
    }
    decode="--runs 3 --new-tokens 128"
    # The all-reduce timings (NCCL and one-shot: a CUDA graph of one token's all-reduces) come with each model
    # whichever all-reduce it runs. Llama-3-8B first (TP2 against one GPU, both all-reduces), then 70B.
    run tp-8b timeout "$(budget)" $launch benchmarks/bench.py --tp 2 --model Llama-3-8B --quant none \
        --all-reduce nccl,oneshot $decode --json "$RESULTS/tp-8b.json"
    run tp-8b-one-gpu timeout "$(budget)" python3 benchmarks/bench.py --model Llama-3-8B --quant none $decode \
        --json "$RESULTS/tp-8b-one-gpu.json"
    run tp-70b timeout "$(budget)" $launch benchmarks/bench.py --tp 2 --model Llama-2-70B --quant none \
        --all-reduce nccl,oneshot $decode --json "$RESULTS/tp-70b.json"
    # int8 with the one-shot all-reduce stalls at 70B (BENCHMARKS.md, Tensor parallel): NCCL until that is found.
    run tp-70b-int8 timeout "$(budget)" $launch benchmarks/bench.py --tp 2 --model Llama-2-70B --quant int8 \
        --all-reduce nccl $decode --json "$RESULTS/tp-70b-int8.json"
    run tp-tests timeout "$(budget)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tensor_parallel.py
    reports=$(ls "$RESULTS"/tp-8b-one-gpu.json "$RESULTS"/tp-8b.json "$RESULTS"/tp-70b*.json 2>/dev/null | paste -sd,)
    echo "== the tables (Llama-3-8B TP2 against one GPU, 70B at TP2, the all-reduce's share of a step)"
    [ -n "$reports" ] && python3 benchmarks/bench.py --merge "$reports" | tee "$RESULTS/tp-table.md"
    ;;
fp8)
    # FP8 (W8A8) beside bf16: the fixed workload, then batch-1 decode beside int8, one call on one GPU.
    for quant in none fp8; do
        run engine-fixed-$quant python3 benchmarks/bench_serving.py --model Llama-3-8B --workload fixed \
            --num-requests 1024 --quant $quant --json "$RESULTS/engine-fixed-$quant.json"
    done
    run decode-fp8 python3 benchmarks/bench.py --model Llama-3-8B --quant none,int8,fp8 --runs 3 --new-tokens 200 \
        --json "$RESULTS/decode-fp8.json"
    ;;
fp8-mixed)
    for quant in none fp8; do
        run engine-mixed-$quant python3 benchmarks/bench_serving.py --model Llama-3-8B --workload mixed \
            --quant $quant --json "$RESULTS/engine-mixed-$quant.json"
    done
    ;;
tp-tests)
    # The 2-GPU tests alone (the tp part runs them last, when its measurements leave time).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    run tp-tests python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_tensor_parallel.py
    ;;
tp4)
    # 4 GPUs: Llama-2-70B bf16 at TP4 and Llama-3.1-405B int4 g128 at TP4, batch-1 decode.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    [ "$gpus" -ge 4 ] || { echo "the tp4 part needs 4 GPUs; this machine has $gpus" >&2; exit 2; }
    launch="python3 -m torch.distributed.run --nproc_per_node 4 --master_addr 127.0.0.1 --master_port 29519"
    decode="--runs 3 --new-tokens 128"
    run tp4-70b timeout "${TP_SECONDS:-280}" $launch benchmarks/bench.py --tp 4 --model Llama-2-70B --quant none \
        --all-reduce nccl,oneshot $decode --json "$RESULTS/tp4-70b.json"
    run tp4-405b timeout "${TP_SECONDS:-280}" $launch benchmarks/bench.py --tp 4 --model Llama-3.1-405B --quant int4 \
        --groupsize 128 --all-reduce oneshot $decode --json "$RESULTS/tp4-405b.json"
    ;;
tp-serving)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    run tp-serving-70b python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \
        --master_port 29518 benchmarks/bench_serving.py --model "${TP_MODEL:-Llama-3.1-70B}" --workload fixed \
        --num-requests 1024 $extra --json "$RESULTS/tp-serving-70b.json"
    ;;
tp-serve)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    port=${PORT:-8322}
    python3 serve.py --random-weights "${TP_MODEL:-Llama-3.1-70B}" --dtype bfloat16 --tensor-parallel 2 \
        --port $port $extra >"$RESULTS/tp-server.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null' EXIT
    for _ in $(seq 600); do  # /health answers 200 once every rank loaded, captured its graphs and warmed up
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 $server 2>/dev/null || { echo "serve.py exited; see $RESULTS/tp-server.log"; exit 1; }
        sleep 1
    done
    grep "redline" "$RESULTS/tp-server.log" | tail -4
    run tp-serve-256 python3 benchmarks/bench_serve.py --base-url "http://127.0.0.1:$port" --num-prompts 256 \
        --input-len 128 --output-len 128 --vocab-size 128256 --json "$RESULTS/tp-serve-256.json"
    kill -TERM $server && wait $server
    ;;
fp8-kv)
    # The e4m3 KV cache (--kv-cache-dtype fp8) beside the model-dtype one on random Llama-3.1-8B weights (Llama-3-8B's
    # shapes, with the context for 32k prompts): each run prints its pool's capacity in tokens (the same share of free
    # memory) and the decode ITL of 4 rows at 32,000 prompt tokens (decode steps as CUDA graphs; the prompts'
    # 4,096-token chunks eager, which spares each run the prefill step's compile); then the e4m3-cache GPU tests.
    for kv in auto fp8; do
        run "fp8-kv-long-$kv" python3 benchmarks/bench_serving.py --model Llama-3.1-8B --workload long \
            --num-requests 4 --prompt-tokens 32000 --max-running 4 --no-compile-prefill --kv-cache-dtype $kv \
            --json "$RESULTS/fp8-kv-long-$kv.json"
    done
    run fp8-kv-tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_attention_fp8.py \
        tests/test_kv_fp8.py
    ;;
*)
    echo "unknown part '$part'; use tests, engine, engine-eager, families, moe, serve, serve-offline, frontdoor," \
        "frontdoor-pair, frontdoor-offline, hf-int4, vision, serve-json, fp8, fp8-mixed, fp8-kv, tp, tp-tests, tp4, tp-serving or tp-serve" >&2
    exit 2
    ;;
esac
echo "results in $RESULTS"
