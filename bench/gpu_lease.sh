#!/usr/bin/env bash
# bench/gpu_lease.sh: the one command to run on a lent GPU machine (no network, 15 minutes), from the repository
# root, with the bundle of `make gpu-bundle` carried (outputs/gpu-bundle/):
#
#   OUT=<folder> bash bench/gpu_lease.sh [--allow-cpu] [--budget S] [--only STEP,STEP]
#
# It unpacks the bundle (what the machine's own Python lacks), sets every offline variable, prints the GPU,
# driver, torch, CUDA and the machine's own versions of what the bundle leaves to it, then runs its steps in order
# of what they decide, each under a time-out of its own of at least 1.5 times what the first GPU run needed,
# BUDGET_S (480 s) in all, the start included; a step that finishes early leaves its time to the next:
#   gate          every requirement of the bundle met by this Python, every pipeline module and bundled package
#                 imported; if not, one line each and the lease stops (nothing after it could run)
#   sweep         make test-gpu's sweep on the Trainer (bench/gpu_check.py): AdamW, Adafactor, 8-bit AdamW on
#                 MiniLM, each peak against its plan for this GPU
#   real_size     Llama-3.1-8B as a language model on the GPU, batch 1: QLoRA and LoRA, each peak against its plan
#   batch_search  make test-gpu's known allocation and find_batch_size steps
#   real_size_2   the real-size points at batch 2, full fine-tuning with 8-bit AdamW among them
#   quick         two warm jobs with their own peaks, AdaLomo on CUDA (pytest, full tracebacks)
#   budget        make test-gpu's budget step: parallel warm jobs, one out of memory
#   rest          the other tests marked gpu (REST_TESTS, in order of what they decide), with the time left
# The time-outs of the first three fill the 480 s, the start and the summary's reserve included; the later steps
# run in what the earlier ones leave.
# The job starter is kept across the steps (one environment for them all), so only the first job imports.
# Exit code 0 when every step that ran passed, 1 otherwise, 143 when stopped.
# Whatever happens (a step killed at its time-out, SIGTERM, Ctrl-C) it leaves in $OUT two files: summary.md
# (the machine, each step's result, time and whether it ran out of time, each step's figures) and logs.tar.gz
# (every log, each step's summary and the jobs' error files). Work files go to $LEASE_WORK (default: a new
# folder under /tmp). --allow-cpu: without a GPU, every step on CPU on the tiny models (a check of this script;
# its time-outs are a GPU's, so the CPU's slower steps may time out). --only: some steps (a second call in the
# same lease). docs/gpu.md (the lease script) says what comes back and how to read it.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

BUDGET_S=480
ALL_STEPS="gate sweep real_size batch_search real_size_2 quick budget rest"
# the make test-gpu steps': bench/gpu_check.py's own time-outs (1.5 x what the first GPU run needed: the known
# allocation 11 s, the batch search 46 s, a job started cold up to 40 s, so 60 s a job and 20 s a sweep's own
# start), 10 s for that script's start and 5 s of grace a step; the gate's: 4 x its 11 s on 2 busy CPU cores;
# 0: the time left
declare -A LIMIT_S=([gate]=45 [sweep]=220 [real_size]=185 [batch_search]=115 [real_size_2]=270 [quick]=100
    [budget]=165 [rest]=0)
# (each settable from the environment, as the tests of the lease's own time-outs set them smaller)
GRACE_S=${LEASE_GRACE_S:-10}       # between a step's SIGTERM at its time-out and its SIGKILL
RESERVE_S=${LEASE_RESERVE_S:-15}   # kept for the summary and the tarball at the end
MIN_STEP_S=${LEASE_MIN_STEP_S:-20} # a step given less than this is skipped
QUICK_TESTS=(
    "tests/test_gpu.py::test_two_jobs_started_warm_on_the_gpu_finish_with_their_own_peaks"
    "tests/test_optimizers.py::test_adalomo_on_cuda_as_it_is"
)
REST_TESTS=(  # in order of what they decide
    "tests/test_gpu.py::test_breakdown_and_prediction_on_cuda"
    "tests/test_gpu.py::test_fp32_bf16_and_fp16_on_both_backends_record_allocator_peaks"
    "tests/test_gpu.py::test_cuda_peak_of_a_known_allocation"
    "tests/test_gpu.py::test_find_batch_size_on_cuda_within_a_budget"
    "tests/test_scale.py::test_parallel_sweep_on_gpus_gives_each_running_job_its_own_device"
    "tests/test_scale.py::test_two_rank_jobs_on_gpus_with_nccl_zero1_and_fsdp"
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
        echo "| step | result | seconds | time-out [s] | ran out of time |"
        echo "| --- | --- | --- | --- | --- |"
        awk -F'\t' '{out = ($2 ~ /^TIMED OUT/) ? "yes" : ($2 ~ /^skipped/) ? "not run" : "no";
            printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, out}' "$WORK/steps.tsv"
        while IFS=$'\t' read -r name result _; do
            [[ "$result" == skipped* ]] && continue
            echo
            echo "## $name"
            echo
            if [ -f "$WORK/check-$name/summary.md" ]; then
                cat "$WORK/check-$name/summary.md"
            elif [ -f "$LOGS/$name.log" ]; then
                echo '```'
                # the gate's lines; pytest: its short summary (-rA), or where it was killed the -v line of each
                # test that ended; the errors' E lines; its last line
                grep -E '^gpu-gate:' "$LOGS/$name.log" | head -20
                { grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ' "$LOGS/$name.log" ||
                    grep -E '::.* (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)' "$LOGS/$name.log"; } | head -60
                grep -E '^E ' "$LOGS/$name.log" | head -40
                tail -n 1 "$LOGS/$name.log" | grep -v '^gpu-gate:'
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
    leftovers all >/dev/null
    exit 143
}
leftovers() {  # kill what a step left running (in sessions of its own too), found by the lease's mark: all of
    # it with `all`, else all but the job starter, kept for the next step's jobs (the jobs forked from it go)
    local pid parent killed=0
    for pid in $(grep -lszxF "GPU_LEASE=$$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
        [ "$pid" = "$$" ] && continue
        if [ "${1:-}" != all ] && cat "/proc/$pid/cmdline" 2>/dev/null | tr '\0' ' ' | grep -q 'pipeline\.starter'; then
            parent=$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null)
            cat "/proc/$parent/cmdline" 2>/dev/null | tr '\0' ' ' | grep -q 'pipeline\.starter' || continue
        fi
        kill -KILL "$pid" 2>/dev/null && killed=$((killed + 1))
    done
    echo "$killed"
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
    others=$(cd "$(dirname "$BUNDLE")" 2>/dev/null && ls gpu-bundle-cp*.tar.xz 2>/dev/null | tr '\n' ' ')
    if [ -n "$others" ]; then
        echo "gpu_lease: this machine's Python is CPython ${pyver:0:1}.${pyver:1}, the bundle here is for another (${others% }): build one with make gpu-bundle GPU_PYTHON=${pyver:0:1}.${pyver:1} where pip works" | tee "$LOGS/machine.log"
    else
        echo "gpu_lease: $BUNDLE is missing and $PYTHON lacks the pipeline's packages: run make gpu-bundle where pip works, and carry outputs/gpu-bundle" | tee "$LOGS/machine.log"
    fi
    exit 1
fi
# one environment for every step, so that the job starter the first job starts serves the later steps' jobs too
# (kept to the lease's end: PIPELINE_STARTER_KEEP_S); GPU_LEASE marks every process the lease started
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
    MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false \
    PIPELINE_CACHE_DIR="$WORK/cache" PIPELINE_STARTER_KEEP_S="$BUDGET_S" GPU_LEASE="$$"
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
    # the machine's own versions of what the bundle may leave to it: bench/gpu_machine.json records them
    env -u PYTHONPATH "$PYTHON" - "$ROOT/bench/gpu_machine.json" <<'EOF' 2>&1
import importlib.metadata as md, json, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "none"
print("the machine's own: " + ", ".join(f"{n} {version(n)}" for n in json.load(open(sys.argv[1]))["packages"]))
EOF
} >"$LOGS/machine.log"
cat "$LOGS/machine.log"
if [ -z "$allow_cpu" ] && ! "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_lease: torch sees no GPU here (--allow-cpu runs the steps on CPU)" | tee -a "$LOGS/machine.log"
    exit 1
fi

# ---- the steps ------------------------------------------------------------------------------------------------
check() {  # CMD: a bench.gpu_check call of these steps, within the step's time-out, into check-<step>/
    local name=$1 steps=$2
    shift 2
    CMD=("$PYTHON" -m bench.gpu_check --only "$steps" --no-docs --out "$WORK/check-$name"
        --within $((CURRENT_LIMIT - 5)) --set model.pretrained=false "$@")
    if [ -n "$allow_cpu" ] && [[ "$name" == real_size* ]]; then
        CMD+=(--allow-cpu --set model=llama-tiny --set train.max_length=128)
    elif [ -n "$allow_cpu" ]; then  # (a budget the tiny model's batch 4096 passes on CPU, as in tests/test_gpu_ready.py)
        CMD+=(--allow-cpu --set model=tiny --set memory_budget_mb=60)
    fi
}
set_command() {  # CMD: the step's command
    case "$1" in
    gate) CMD=("$PYTHON" -m bench.gpu_bundle --check "$WORK/bundle.json") ;;
    sweep) check sweep sweep --set backend=trainer ;;  # (the first run: both backends gave the same figures)
    real_size) check real_size real_qlora,real_lora ;;
    batch_search) check batch_search known_allocation,batch_search ;;
    real_size_2) check real_size_2 real_qlora,real_lora,real_full --set batch_size=2 ;;
    quick) CMD=("$PYTHON" -m pytest -p no:cacheprovider -m gpu -v --tb=long -rA "${QUICK_TESTS[@]}") ;;
    budget) check budget budget ;;
    rest) CMD=("$PYTHON" -m pytest -p no:cacheprovider -m gpu -v --tb=long -rA --durations=0 "${REST_TESTS[@]}") ;;
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
    timeout --signal=TERM --kill-after="$GRACE_S" "$limit" "${CMD[@]}" >"$LOGS/$step.log" 2>&1 </dev/null &
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
    orphans=$(leftovers)  # the next step gets the GPU to itself
    ((orphans > 0)) && result="$result; $orphans process(es) it left killed"
    echo -e "$step\t$result\t$seconds\t$limit" >>"$WORK/steps.tsv"
    echo "[gpu-lease] $step: $result in ${seconds} s"
    finish
    if [ "$step" = gate ] && [ "$code" != 0 ]; then  # nothing after it could run
        grep '^gpu-gate:' "$LOGS/gate.log" | sed 's/^gpu-gate/gpu_lease/' | head -5
        break
    fi
done
leftovers all >/dev/null  # the job starter too
finish
echo
cat "$OUT/summary.md"
echo "[gpu-lease] in $OUT: $(cd "$OUT" && ls | tr '\n' ' '); work folder $WORK"
# 0 when every step that ran passed, 1 otherwise
! cut -f2 "$WORK/steps.tsv" | grep -qv -e '^ok' -e '^skipped'
