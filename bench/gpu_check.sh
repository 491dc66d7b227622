#!/usr/bin/env bash
# One run on a bare GPU machine (an H200 lent for a few minutes): the GPU tests and every GPU
# figure of issues 3/12/13, printed, with the raw figures left under $OUT. Prepare on the CPU
# machine with `make gpu-wheels` (the wheels that machine lacks), then run there, carrying .whl:
#     bash bench/gpu_check.sh            # under 8 minutes: each step has its own time limit
# Python 3.12 + torch/CUDA + triton come with the machine; nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
SITE=/tmp/site
step() { echo; echo "=== $* ($(date +%T))"; }
# Every step's limit is cut to what is left of 470 s, so the whole script ends within 8 minutes; the
# steps run most important first (issue 12's load path, issue 13's kernels, the GPU tests).
DEADLINE=$(( $(date +%s) + 470 ))
lim() { local left=$(( DEADLINE - $(date +%s) )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tail -n +1
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'

step "carried wheels -> $SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target "$SITE" .whl/*.whl 2>&1 | tail -3
else
  echo "no .whl/ here: run 'make gpu-wheels' on the CPU machine and carry .whl"
fi
export PYTHONPATH="$SITE:$PWD"
python3 -c 'import grpc, google.protobuf, lmdb, xxhash; print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__, "lmdb", lmdb.version())' || exit 1

step "prefix reuse: random:llama3-8b cut to 8 layers, 8000-token prompt (one prefill step), store node on this host"
timeout $(lim 150) python3 bench/prefix_reuse_bench.py --model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' \
  --prompt-tokens 8000 --chunk-size 8192 --reps 3 --dram 4GiB --kv-cache-memory 8GiB \
  --json "$OUT/prefix_reuse_gpu.json" 2>&1 | grep -v Warning
cp bench/out/prefix_reuse_gpu.png "$OUT/" 2>/dev/null

step "kernels (decode / prefill attention, page copies, fp8) against their PyTorch twins, quick grid; engine ITL vs HBM floor"
timeout $(lim 140) python3 bench/kernels_bench.py --quick --out "$OUT" 2>&1 | grep -v Warning | tail -45

step "pytest -m gpu (engine data path, CUDA graphs, CUDA movers, device tier, compiled kernels on sm_90)"
# NOTE: TRITON_INTERPRET=0: tests/kernels/conftest.py defaults it to 1 (CPU runs) for the whole session.
TRITON_INTERPRET=0 timeout $(lim 140) python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -25

step "DRAM -> GPU with --land-direct: the landing kernel reads the registered arena in place (no DMA into a stage)"
timeout $(lim 70) python3 bench/prefix_reuse_bench.py --model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' \
  --prompt-tokens 8000 --chunk-size 8192 --reps 1 --dram 4GiB --kv-cache-memory 8GiB --land-direct \
  --json "$OUT/prefix_reuse_gpu_direct.json" 2>&1 | grep -v Warning

step "HBM -> GPU: the same, the prefix in the node's device tier, read device to device through CUDA IPC"
timeout $(lim 80) python3 bench/prefix_reuse_bench.py --model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' \
  --prompt-tokens 8000 --chunk-size 8192 --reps 1 --dram 4GiB --hbm 4GiB --kv-cache-memory 8GiB \
  --json "$OUT/prefix_reuse_gpu_hbm.json" 2>&1 | grep -v Warning
cp bench/out/prefix_reuse_gpu_hbm.png "$OUT/" 2>/dev/null

step "Disk -> GPU: the same, the prefix on the node's disk tier (O_DIRECT, --no-promote, DRAM 128MiB < the prompt's 250 MiB of KV)"
timeout $(lim 80) python3 bench/prefix_reuse_bench.py --model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' \
  --prompt-tokens 8000 --chunk-size 8192 --reps 1 --dram 128MiB --kv-cache-memory 8GiB --disk-tier --disk-size 8GiB \
  --json "$OUT/prefix_reuse_gpu_disk.json" 2>&1 | grep -v Warning
cp bench/out/prefix_reuse_gpu_disk.png "$OUT/" 2>/dev/null

step "another host's engine (tcp): chunks streamed layer-major beside the step vs the pinned pool's chunk-major load"
timeout $(lim 70) python3 bench/prefix_reuse_bench.py --model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' \
  --prompt-tokens 8000 --chunk-size 8192 --reps 1 --dram 4GiB --kv-cache-memory 8GiB --transport tcp \
  --json "$OUT/prefix_reuse_gpu_tcp.json" 2>&1 | grep -v Warning
cp bench/out/prefix_reuse_gpu_tcp.png "$OUT/" 2>/dev/null

step "speculative decoding: a step verifying K drafts vs a plain decode step, random:llama3-8b cut to 8 layers, 4k context"
timeout $(lim 40) python3 bench/spec_decode_bench.py --verify-cost --model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' \
  --context 4096 --batch 1,8 --ks 1,2,4,8 --kv-cache-memory 8GiB --json "$OUT/spec_verify_gpu.json" 2>&1 | grep -v Warning

step "tile-config sweep of prefill and decode on this GPU -> $OUT/configs/ (commit as kernels/configs/)"
timeout $(lim 90) python3 bench/kernels_bench.py --sweep --out "$OUT" 2>&1 | grep -v Warning | tail -30

step "done"
ls -la "$OUT"
