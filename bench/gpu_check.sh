#!/usr/bin/env bash
# One run on a bare GPU machine (an H200 lent for a few minutes): the GPU tests and every GPU
# figure of issues 3/12/13, printed, with the raw figures left under $OUT. Prepare on the CPU
# machine with `make gpu-wheels` (the wheels that machine lacks), then run there, carrying .whl:
#     bash bench/gpu_check.sh            # under 8 minutes: each step has its own time limit
# Python 3.12 + torch/CUDA + triton come with the machine; nothing is downloaded.
# What comes back fits the device tool (at most 8 files; the last 12,000 characters of output):
# $OUT/gpu_check.log (everything printed), $OUT/figures.tgz (every JSON, PNG and table, written
# on exit, a killed run too) and the tuned kernel configs, $OUT/<device>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
FIG=/tmp/gpu_figs
mkdir -p "$OUT" "$FIG"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE=$!
pack() {
  cp bench/out/*.png "$FIG/" 2>/dev/null
  tar czf "$OUT/figures.tgz" -C "$FIG" . 2>/dev/null
  cp "$FIG"/configs/*.json "$OUT/" 2>/dev/null
  echo "packed: $(ls "$OUT" | tr '\n' ' ')"
  exec >&- 2>&-
  wait "$TEE" 2>/dev/null  # the log complete before the command returns
}
trap pack EXIT
trap "exit 143" TERM INT  # (the EXIT trap packs on these too)
SITE=/tmp/site
step() { echo; echo "=== $* ($(date +%T))"; }
# Every step's limit is cut to what is left of 470 s, so the whole script ends within 8 minutes; the
# steps run most important first (issue 12's load path, issue 13's kernels, the GPU tests).
DEADLINE=$(( $(date +%s) + 470 ))
lim() { local left=$(( DEADLINE - $(date +%s) )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
export PYTHONUNBUFFERED=1
LLAMA8=(--model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' --prompt-tokens 7900 --chunk-size 8192
        --kv-cache-memory 8GiB)

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tail -n +1
df -h /dev/shm /tmp | tail -n +1  # (the store node's arena lives in /dev/shm: 4 GiB in the steps below)
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'

step "carried wheels -> $SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target "$SITE" .whl/*.whl 2>&1 | tail -3
else
  echo "no .whl/ here: run 'make gpu-wheels' on the CPU machine and carry .whl"
fi
export PYTHONPATH="$SITE:$PWD"
python3 -c 'import grpc, grpc_health.v1.health, google.protobuf, lmdb, xxhash, zmq; print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__, "lmdb", lmdb.version())' || exit 1
# Structured outputs (optional): xgrammar and its needs, installed apart so that they cannot fail the above.
if ls .whl/structured/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target "$SITE" .whl/structured/*.whl 2>&1 | tail -3
fi
python3 -c 'import xgrammar; print("xgrammar", xgrammar.__version__)' 2>&1 | tail -1

step "prefix reuse: random:llama3-8b cut to 8 layers, 7900-token prompt (8000 + 1 overflows its 8192 context at 50%) (one prefill step), store node on this host"
timeout $(lim 110) python3 bench/prefix_reuse_bench.py "${LLAMA8[@]}" --reps 2 --dram 4GiB \
  --json "$FIG/prefix_reuse_gpu.json" 2>&1 | grep -v Warning

step "kernels (decode / prefill attention, page copies, fp8) against their PyTorch twins, quick grid; engine ITL vs HBM floor"
timeout $(lim 100) python3 bench/kernels_bench.py --quick --out "$FIG" 2>&1 | grep -v Warning | tail -70

step "pytest -m gpu (engine data path, CUDA graphs, CUDA movers, device tier, compiled kernels on sm_90)"
# NOTE: TRITON_INTERPRET=0: tests/kernels/conftest.py defaults it to 1 (CPU runs) for the whole session.
TRITON_INTERPRET=0 timeout -s INT -k 15 $(lim 90) python3 -m pytest -q -p no:cacheprovider -m gpu tests \
  --continue-on-collection-errors -rfE --durations=10 --junitxml "$FIG/pytest_gpu.xml" 2>&1 | tail -40

step "vLLM connector's worker path with its caches on this GPU: pinned read buffer, wsum64 on the device, every layer vs layer by layer on a transfer stream, saves DMA'd into the registered arena, a fresh worker's first load with and without warm_up"
timeout $(lim 30) python3 bench/vllm_worker_load_bench.py --device cuda --repeats 3 --first-repeats 2 2>&1 | grep -v Warning | tail -18

step "DRAM -> GPU with --land-direct: the landing kernel reads the registered arena in place (no DMA into a stage)"
timeout $(lim 40) python3 bench/prefix_reuse_bench.py "${LLAMA8[@]}" --reps 1 --dram 4GiB --land-direct \
  --json "$FIG/prefix_reuse_gpu_direct.json" 2>&1 | grep -v Warning

step "HBM -> GPU: the same, the prefix in the node's device tier, read device to device through CUDA IPC"
timeout $(lim 45) python3 bench/prefix_reuse_bench.py "${LLAMA8[@]}" --reps 1 --dram 4GiB --hbm 4GiB \
  --json "$FIG/prefix_reuse_gpu_hbm.json" 2>&1 | grep -v Warning

step "another host's engine (tcp): chunks streamed layer-major beside the step vs the pinned pool's chunk-major load"
timeout $(lim 40) python3 bench/prefix_reuse_bench.py "${LLAMA8[@]}" --reps 1 --dram 4GiB --transport tcp \
  --json "$FIG/prefix_reuse_gpu_tcp.json" 2>&1 | grep -v Warning

step "Disk -> GPU: the same, the prefix on the node's disk tier (O_DIRECT, --no-promote, DRAM 128MiB < the prompt's 250 MiB of KV)"
timeout $(lim 40) python3 bench/prefix_reuse_bench.py "${LLAMA8[@]}" --reps 1 --dram 128MiB --disk-tier --disk-size 8GiB \
  --json "$FIG/prefix_reuse_gpu_disk.json" 2>&1 | grep -v Warning

step "tile-config sweep of prefill and decode on this GPU -> configs/<device>.json (commit as kernels/configs/)"
timeout $(lim 50) python3 bench/kernels_bench.py --sweep --out "$FIG" 2>&1 | grep -v Warning | tail -30

step "speculative decoding: a step verifying K drafts vs a plain decode step, random:llama3-8b cut to 8 layers, 4k context"
timeout $(lim 25) python3 bench/spec_decode_bench.py --verify-cost --model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' \
  --context 4096 --batch 1,8 --ks 1,2,4,8 --kv-cache-memory 8GiB --json "$FIG/spec_verify_gpu.json" 2>&1 | grep -v Warning

step "the engine's host time per decode step on this machine's CPU (what a replayed graph leaves), against the H200 floor"
timeout $(lim 20) python3 bench/engine_host_bench.py --steps 100 --reps 1 2>&1 | tail -10

step "done"
ls -la "$FIG"
