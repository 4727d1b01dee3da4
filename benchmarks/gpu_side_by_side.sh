#!/usr/bin/env bash
# Parts of gpu_run.sh side by side on the GPUs of one machine: each argument is GPUS:PART[,PART...], the parts of one
# argument run one after the other on those GPUs, the arguments at the same time. From the repository root:
#
#   bash benchmarks/gpu_side_by_side.sh 0,1:tp 2:tests@0/2 3:tests@1/2,serve-json
#
# (tests@i/n: the i-th of n shares of the GPU test files.) Every result is also packed into RESULTS.tar.gz.
# Each argument gets its own CUDA_VISIBLE_DEVICES, results folder (RESULTS/GPUS-PART), server port and log
# (RESULTS/GPUS-PART.log). SECONDS_LEFT (default 570) bounds every part: a part still running then is stopped, and
# the others' results stay. Timings of parts that share a machine are each on their own GPUs, but they share its
# CPU cores and host memory bandwidth: the README's numbers come from parts run this way only where BENCHMARKS.md
# says so.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash benchmarks/gpu_side_by_side.sh GPUS:PART[,PART...] ..." >&2; exit 2; }
RESULTS=${RESULTS:-benchmarks/results/gpu-run}
limit=${SECONDS_LEFT:-570}
mkdir -p "$RESULTS"
for group in "$@"; do  # every argument checked before any part starts
    [ "${group%%:*}" != "$group" ] && [ -n "${group#*:}" ] \
        || { echo "bad argument '$group': use GPUS:PART[,PART...]" >&2; exit 2; }
done
if [ -z "${WHEELS_INSTALLED:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then  # once (gpu_run.sh then skips it)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} WHEELS_INSTALLED=1
fi
pids=()
slot=0
for group in "$@"; do
    gpus=${group%%:*}
    parts=${group#*:}
    (
        for spec in ${parts//,/ }; do
            part=${spec%%@*}  # tests@i/n: the i-th of n shares of the GPU test files
            shard=$([ "$spec" != "$part" ] && echo "${spec#*@}" || echo 0/1)
            name="gpu${gpus//,/}-$part${shard/\//of}"
            [ "$shard" = 0/1 ] && name="gpu${gpus//,/}-$part"
            left=$(( limit - SECONDS ))
            [ $left -gt 5 ] || { echo "== $name: no time left" >>"$RESULTS/$name.log"; continue; }
            TEST_SHARD=$shard CUDA_VISIBLE_DEVICES=$gpus RESULTS="$RESULTS/$name" PORT=$(( 8400 + slot )) TP_SECONDS=$(( left - 10 )) \
                timeout -k 10 $left bash benchmarks/gpu_run.sh "$part" >"$RESULTS/$name.log" 2>&1
            echo "== $name: exit status $? after $SECONDS s" >>"$RESULTS/$name.log"
        done
    ) &
    pids+=($!)
    slot=$(( slot + 1 ))
done
wait "${pids[@]}"
# One archive of every result beside the logs (a device run may bring back only a few files).
tar -czf "$RESULTS.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
for log in "$RESULTS"/*.log; do
    echo "===== $log (last lines)"
    tail -n 25 "$log"
done
