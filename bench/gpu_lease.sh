#!/usr/bin/env bash
# bench/gpu_lease.sh: the one command to run on a lent GPU machine (no network, 15 minutes), from the repository
# root, with the bundle of `make gpu-bundle` carried (outputs/gpu-bundle/):
#
#   OUT=<folder> bash bench/gpu_lease.sh [--allow-cpu] [--budget S] [--only STEP,STEP]
#
# It unpacks the bundle (what the machine's own Python lacks), sets every offline variable, prints the GPU,
# driver, torch and CUDA, then runs its steps in order of what they tell per second, each under a time-out of its
# own, BUDGET_S (480 s) in all, the start included:
#   quick         the decisive tests, full tracebacks: a known allocation, two warm jobs with their own peaks,
#                 AdaLomo on CUDA
#   batch_search  make test-gpu's find_batch_size step (bench/gpu_check.py)
#   sweep_budget  make test-gpu's sweep (both backends x 3 optimizers, peak against plan) and budget steps
#   real_size     Llama-3.1-8B as a language model on the GPU: QLoRA, LoRA, full 8-bit AdamW, peak against plan
#   rest          the other tests marked gpu, with the time left
# Exit code 0 when every step that ran passed, 1 otherwise, 143 when stopped.
# Whatever happens (a step killed at its time-out, SIGTERM, Ctrl-C) it leaves in $OUT two files: summary.md
# (the machine, each step's result and time, each step's figures) and logs.tar.gz (every log, each step's
# summary and the jobs' error files). Work files go to $LEASE_WORK (default: a new folder under /tmp).
# --allow-cpu: without a GPU, every step on CPU on the tiny models (a check of this script; its time-outs are a
# GPU's, so the CPU's slower steps may time out). --only: some steps (a second call in the same lease).
# docs/gpu.md (the lease script) says what comes back and how to read it.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

BUDGET_S=480
ALL_STEPS="quick batch_search sweep_budget real_size rest"
declare -A LIMIT_S=([quick]=60 [batch_search]=50 [sweep_budget]=130 [real_size]=170 [rest]=0)  # 0: the time left
GRACE_S=10    # between a step's SIGTERM at its time-out and its SIGKILL
RESERVE_S=15  # kept for the summary and the tarball at the end
MIN_STEP_S=20 # a step given less than this is skipped
QUICK_TESTS=(
    "tests/test_gpu.py::test_cuda_peak_of_a_known_allocation"
    "tests/test_gpu.py::test_two_jobs_started_warm_on_the_gpu_finish_with_their_own_peaks"
    "tests/test_optimizers.py::test_adalomo_on_cuda_as_it_is"
)

ARGS_SHOWN="$*"
allow_cpu="" only=""
while (($#)); do
    case "$1" in
    --allow-cpu) allow_cpu=1 ;;
    --budget) BUDGET_S="$2"; shift ;;
    --only) only="${2//,/ }"; shift ;;
    -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_lease: unknown argument '$1' (allowed: --allow-cpu, --budget S, --only STEP,STEP)" >&2; exit 2 ;;
    esac
    shift
done
for step in $only; do
    [[ " $ALL_STEPS " == *" $step "* ]] || { echo "gpu_lease: unknown step '$step' (allowed: ${ALL_STEPS// /, })" >&2; exit 2; }
done
STEPS="${only:-$ALL_STEPS}"

START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
OUT="${OUT:-$ROOT/outputs/gpu-lease/out-$(date +%Y-%m-%d_%H-%M-%S)}"
WORK="${LEASE_WORK:-$(mktemp -d /tmp/gpu-lease.XXXXXX)}"
LOGS="$WORK/logs"
mkdir -p "$OUT" "$LOGS"
OUT="$(cd "$OUT" && pwd)" WORK="$(cd "$WORK" && pwd)"
: >"$WORK/steps.tsv"
STEP_PID="" STOPPED=""

# ---- the summary and the tarball: after each step, and once more whatever ends this script ----------------
finish() {
    local now=$(( $(date +%s) - START ))
    {
        echo "# GPU lease, $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo
        echo "Command: \`OUT=... bash bench/gpu_lease.sh ${ARGS_SHOWN}\`; ${now} s of a ${BUDGET_S} s budget${STOPPED:+; stopped by $STOPPED}."
        echo
        sed 's/^/    /' "$LOGS/machine.log" 2>/dev/null
        echo
        echo "| step | result | seconds | time-out [s] |"
        echo "| --- | --- | --- | --- |"
        awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}' "$WORK/steps.tsv"
        while IFS=$'\t' read -r name result _; do
            [[ "$result" == skipped* ]] && continue
            echo
            echo "## $name"
            echo
            if [ -f "$WORK/check-$name/summary.md" ]; then
                cat "$WORK/check-$name/summary.md"
            elif [ -f "$LOGS/$name.log" ]; then
                echo '```'
                # pytest: its short summary (-rA), or where it was killed the -v line of each test that ended;
                # the errors' E lines; its last line
                { grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ' "$LOGS/$name.log" ||
                    grep -E '::.* (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)' "$LOGS/$name.log"; } | head -60
                grep -E '^E ' "$LOGS/$name.log" | head -40
                tail -n 1 "$LOGS/$name.log"
                echo '```'
            fi
        done <"$WORK/steps.tsv"
    } >"$OUT/summary.md.partial" && mv "$OUT/summary.md.partial" "$OUT/summary.md"
    # every log, each step's summary, the jobs' error files and logs (no stores, no caches): one file
    (cd "$WORK" && find . \( -name '*.log' -o -name 'summary.*' -o -name 'error.txt' -o -name 'failure.json' \
        -o -name 'steps.tsv' \) -not -path './site-packages/*' -not -path './cache/*' -size -4M -print0 |
        tar -czf "$OUT/logs.tar.gz.partial" --null -T - 2>/dev/null) && mv "$OUT/logs.tar.gz.partial" "$OUT/logs.tar.gz"
}
stop() {  # SIGTERM or SIGINT: the running step gets SIGTERM (timeout passes it on), then the summary
    STOPPED="$1"
    if [ -n "$STEP_PID" ]; then
        kill -TERM "$STEP_PID" 2>/dev/null  # timeout passes it on to the step
        for _ in $(seq "$GRACE_S"); do kill -0 "$STEP_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$STEP_PID" 2>/dev/null  # timeout leads the step's process group: all of it
        echo -e "$CURRENT\tstopped ($1)\t$(( $(date +%s) - STEP_START ))\t$CURRENT_LIMIT" >>"$WORK/steps.tsv"
    fi
    exit 143
}
trap finish EXIT
trap 'stop SIGTERM' TERM
trap 'stop SIGINT' INT

# ---- the Python, the bundle, the offline environment --------------------------------------------------------
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
pyver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")') || {
    echo "gpu_lease: no Python at '$PYTHON'" | tee "$LOGS/machine.log"; exit 1; }
BUNDLE="${BUNDLE:-$ROOT/outputs/gpu-bundle/gpu-bundle-cp$pyver.tar.xz}"
if [ -f "$BUNDLE" ]; then
    # (Python's own tarfile and lzma: no xz program needed on the machine)
    "$PYTHON" -c 'import sys, tarfile
tarfile.open(sys.argv[1]).extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' \
        "$BUNDLE" "$WORK" ||
        { echo "gpu_lease: could not unpack $BUNDLE" | tee "$LOGS/machine.log"; exit 1; }
    export PYTHONPATH="$WORK/site-packages:$ROOT"
    bundle_line="bundle: $(basename "$BUNDLE"), $(du -m "$BUNDLE" | cut -f1) MB, unpacked into $WORK/site-packages"
elif "$PYTHON" -c "import mlflow, hydra, datasets" 2>/dev/null; then
    export PYTHONPATH="$ROOT"
    bundle_line="bundle: none ($PYTHON has the pipeline's packages)"
else
    echo "gpu_lease: $BUNDLE is missing and $PYTHON lacks the pipeline's packages: run make gpu-bundle where pip works, and carry outputs/gpu-bundle" | tee "$LOGS/machine.log"
    exit 1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
    MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false \
    PIPELINE_CACHE_DIR="$WORK/cache"
unset MLFLOW_TRACKING_URI

{
    echo "$bundle_line"
    echo "python: $PYTHON ($("$PYTHON" -c 'import platform; print(platform.python_version())'))"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/nvidia-smi: /' | head -8
    else
        echo "nvidia-smi: none here"
    fi
    "$PYTHON" - <<'EOF' 2>&1
import importlib.metadata as md
import torch
cuda = torch.cuda.is_available()
line = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count() if cuda else 0} GPU(s) seen"
if cuda:
    p = torch.cuda.get_device_properties(0)
    line += f": {p.name}, {p.total_memory / 2**20:,.0f} MiB, {p.multi_processor_count} SMs x {p.max_threads_per_multi_processor} threads"
print(line)
names = ("transformers", "accelerate", "peft", "bitsandbytes", "torchao", "datasets", "mlflow", "hydra-core")
print(", ".join(f"{n} {md.version(n)}" for n in names))
EOF
} >"$LOGS/machine.log"
cat "$LOGS/machine.log"
if [ -z "$allow_cpu" ] && ! "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_lease: torch sees no GPU here (--allow-cpu runs the steps on CPU)" | tee -a "$LOGS/machine.log"
    exit 1
fi

# ---- the steps ------------------------------------------------------------------------------------------------
leftovers() {  # kill what a step left running (in sessions of its own too), found by the mark it inherited
    local pid killed=0
    for pid in $(grep -lszxF "GPU_LEASE_STEP=$$:$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
        [ "$pid" != "$$" ] && kill -KILL "$pid" 2>/dev/null && killed=$((killed + 1))
    done
    echo "$killed"
}
check() {  # CMD: a bench.gpu_check call of these steps, within the step's time-out, into check-<step>/
    local name=$1 steps=$2
    CMD=("$PYTHON" -m bench.gpu_check --only "$steps" --no-docs --out "$WORK/check-$name"
        --within $((CURRENT_LIMIT - 5)) --set model.pretrained=false)
    if [ -n "$allow_cpu" ] && [ "$name" = real_size ]; then
        CMD+=(--allow-cpu --set model=llama-tiny --set train.max_length=128)
    elif [ -n "$allow_cpu" ]; then
        CMD+=(--allow-cpu --set model=tiny)
    fi
}
set_command() {  # CMD: the step's command
    case "$1" in
    quick) CMD=("$PYTHON" -m pytest -p no:cacheprovider -m gpu -v --tb=long -rA "${QUICK_TESTS[@]}") ;;
    batch_search) check batch_search batch_search ;;
    sweep_budget) check sweep_budget sweep,budget ;;
    real_size) check real_size real_qlora,real_lora,real_full ;;
    rest)
        CMD=("$PYTHON" -m pytest -p no:cacheprovider -m gpu -v --tb=long -rA --durations=0)
        for t in "${QUICK_TESTS[@]}"; do CMD+=(--deselect "$t"); done ;;
    esac
}

for step in $STEPS; do
    left=$((DEADLINE - $(date +%s) - RESERVE_S - GRACE_S))
    limit=${LIMIT_S[$step]}
    ((limit == 0 || limit > left)) && limit=$left
    if ((limit < MIN_STEP_S)); then
        ((left < 0)) && left=0
        echo -e "$step\tskipped: ${left} s left\t0\t" >>"$WORK/steps.tsv"
        echo "[gpu-lease] $step: skipped, ${left} s left"
        continue
    fi
    CURRENT=$step CURRENT_LIMIT=$limit STEP_START=$(date +%s)
    set_command "$step"
    echo "[gpu-lease] $step (time-out ${limit} s): ${CMD[*]}"
    GPU_LEASE_STEP="$$:$step" timeout --signal=TERM --kill-after="$GRACE_S" "$limit" "${CMD[@]}" \
        >"$LOGS/$step.log" 2>&1 </dev/null &
    STEP_PID=$!
    wait "$STEP_PID"
    code=$?
    STEP_PID=""
    seconds=$(( $(date +%s) - STEP_START ))
    case $code in
    0) result="ok" ;;
    124 | 137) result="TIMED OUT after ${limit} s" ;;
    *) result="FAILED (exit $code)" ;;
    esac
    orphans=$(leftovers "$step")  # the next step gets the GPU to itself
    ((orphans > 0)) && result="$result; $orphans process(es) it left killed"
    echo -e "$step\t$result\t$seconds\t$limit" >>"$WORK/steps.tsv"
    echo "[gpu-lease] $step: $result in ${seconds} s"
    finish
done
echo
cat "$OUT/summary.md"
echo "[gpu-lease] in $OUT: $(cd "$OUT" && ls | tr '\n' ' '); work folder $WORK"
# 0 when every step that ran passed, 1 otherwise
! cut -f2 "$WORK/steps.tsv" | grep -qv -e '^ok' -e '^skipped'
