#!/usr/bin/env bash
# Every check that needs a GPU, as ONE prepared call on a lent GPU machine, whose device time is short
# (15 minutes a session, the machine's start included): install what the machine lacks from carried
# wheels, then each check under its own time limit, each writing its log (and JSON) under $OUT.
#
#   make gpu-wheels                       # here, once: .whl/ gets the wheels the GPU image lacks
#   device run: command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600
#
# On any machine with a GPU and the package's dependencies: `OUT=outputs/gpu bash benchmarks/gpu_session.sh`.
# The checks, most needed first (issue 40's figures, then the wider GPU checks), and their limits in
# seconds, which add up to under the device tool's 10 minutes a call (570 s of 600):
#   tests      the GPU-marked tests: discovery on this machine's GPUs, Lightning's single-device
#              strategy, the engine on CUDA with NCCL, attention kernels             150
#   one_gpu    benchmarks/bench_one_gpu.py: HexiScaleStrategy() vs a compiled plain loop      220
#   check_gpu  recipes/check_gpu.py: accuracy vs float64, speed, engine memory, Lightning resume 200
# `summary.txt` lists each check's exit status (124: it ran out of time). The GPU image holds torch,
# Lightning, networkx, safetensors, tokenizers, tqdm; it lacks omegaconf, hydra-core, antlr4 and
# pymetis (the device tool's KINDS.md), which `make gpu-wheels` fetches for its Python (3.12).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_session}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_session: installing the carried wheels failed" | tee "$OUT/summary.txt"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'gpus', torch.cuda.device_count())" 2>&1
    git log --oneline -1 2>/dev/null
} | tee "$OUT/summary.txt"

check() {  # check NAME SECONDS COMMAND...: run it under its limit, log to $OUT/NAME.log, record its exit status
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s ($*)" | tee -a "$OUT/summary.txt"
}

check tests 150 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/profiling/test_discover_local.py::test_discover_on_this_machines_gpus \
    tests/models/test_init_device.py tests/runtime/test_gpu.py tests/benchmarks/test_bench_one_gpu.py
check one_gpu 220 python3 benchmarks/bench_one_gpu.py --json "$OUT/one_gpu.json"
check check_gpu 200 python3 recipes/check_gpu.py --json "$OUT/check_gpu.json"
