#!/usr/bin/env bash
# The checks only a GPU can run, in one go (under 8 minutes on one GPU): run it
# from the project root on a CUDA machine with hookloop installed (".[test,bench]").
#
#   bash benchmarks/gpu_check.sh [OUT]       # tables and logs into OUT (default gpu-check/)
#
# 1. bf16 and fp16 (Accelerate's GradScaler) parity with the hand-written loop, and
#    torch.compile (Accelerate's dynamo_backend="inductor") in both loops: parameters
#    bitwise equal to their twin's, per-step ratio (overhead.py, deterministic kernels);
# 2. a BERT-base step (12 layers, 768 wide, batch 16 x 128 tokens) against plain PyTorch;
# 3. the asynchronous save's stall, its host copy into pinned memory, against
#    accelerator.save_state; the synchronous save and a load against Accelerate's
#    (checkpoint_stall.py --device cuda);
# 4. FSDP2 through Accelerate on one GPU (accelerate launch --use_fsdp --fsdp_version 2):
#    train, checkpoint, resume in a new process, parameters bitwise equal to an
#    uninterrupted run (tests/scripts/sharded.py --gpu).
# Each step has its own time limit; a failed step is reported and the others still run;
# the exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python}
failed=0
step() {  # step NAME LIMIT_S COMMAND...: run it, log it, time it
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "== $name (limit ${limit} s)"
    if timeout "$limit" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.log"; then
        echo "   ok in $((SECONDS - start)) s: $OUT/$name.txt"
    else
        echo "   FAILED (exit $?) after $((SECONDS - start)) s; the end of $OUT/$name.log:"
        tail -20 "$OUT/$name.log"
        failed=$((failed + 1))
    fi
}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
    || exit 100

step precision-and-compile 200 "$PY" benchmarks/overhead.py --device cuda --workloads mlp --repeats 2 \
    --variants plain,hand,hookloop,hand-bf16,hookloop-bf16,hand-fp16,hookloop-fp16,hand-compile,hookloop-compile
step bert-base 120 "$PY" benchmarks/overhead.py --device cuda --workloads bert-base --repeats 2
step checkpoint-stall 150 "$PY" benchmarks/checkpoint_stall.py --device cuda --repeats 3 \
    --variants hand-nosave,hand-save_state,hookloop-nosave,hookloop-sync,hookloop-async

fsdp() {  # fsdp OUT EPOCHS: sharded.py on one GPU, FSDP2, resuming from OUT's latest checkpoint
    "$PY" -m accelerate.commands.launch --num_processes 1 --num_machines 1 --use_fsdp --fsdp_version 2 \
        --mixed_precision no --dynamo_backend no --main_process_port 0 \
        tests/scripts/sharded.py "$1" --gpu --processes 1 --mode accelerate --fsdp-version 2 --epochs "$2"
}
fsdp2() {
    rm -rf "$OUT/fsdp2-reference" "$OUT/fsdp2-resumed"
    fsdp "$OUT/fsdp2-reference" 2 && fsdp "$OUT/fsdp2-resumed" 1 && fsdp "$OUT/fsdp2-resumed" 2 && "$PY" - "$OUT" <<'PY'
import json, sys, torch
out = sys.argv[1]
ref, run = (torch.load(f"{out}/fsdp2-{n}/params.pt") for n in ("reference", "resumed"))
report = json.load(open(f"{out}/fsdp2-resumed/run.json"))
differ = [k for k in ref if not torch.equal(ref[k], run[k])]
print(json.dumps({"distributed_type": report["distributed_type"], "model_class": report["model_class"],
                  "resumed_at": report["started_at"], "parameters_differing": differ}))
assert "FSDP" in report["distributed_type"] and report["started_at"] > 0 and not differ, report
PY
}
export OUT PY
export -f fsdp fsdp2
step fsdp2-resume 120 bash -c fsdp2

echo "== $failed step(s) failed; tables in $OUT/*.txt"
exit "$failed"
