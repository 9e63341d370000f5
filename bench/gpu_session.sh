#!/usr/bin/env bash
# Every GPU check of zeroshard in one go, on a machine with a CUDA device (see README, "On a GPU").
#   bash bench/gpu_session.sh OUT_DIR [part ...]      parts: env tests syncs offload* auto* ladder
# offload<X> / auto<X> take their arguments from <PART>_ARGS (e.g. part offload_dpu: OFFLOAD_DPU_ARGS),
# so one session can run several sizes and settings.
# Each part logs to OUT_DIR/<part>.log (and .json where the script writes one); a part that fails
# or runs past its time limit is reported and the next one still runs.
# Part "quick" is a whole session for a 15-minute lease (one call of at most 600 s after a start of 1-2
# minutes): env, the CUDA tests and two in-process test files (180 s), the host-sync count (60 s),
# ZeRO-Offload at 1.82 B with the delayed update (150 s) and auto against the four ZeRO
# configurations under a 24 GB cap (150 s); 560 s of limits in all. Its settings are defaults: the
# variables below override them.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [part ...]}; shift
parts=${*:-env tests syncs offload auto}
if [ "$parts" = quick ]; then
    parts="env tests syncs offload_dpu auto"
    : "${T_ENV:=20}" "${T_TESTS:=180}" "${T_SYNCS:=60}" "${T_OFFLOAD:=150}" "${T_AUTO:=150}" "${WORKERS:=4}"
    : "${TESTS:=tests/test_cuda.py tests/test_tiled_step.py tests/test_world_of_one.py}"
    : "${OFFLOAD_DPU_ARGS:=--n-embd 4096 --n-layer 8 --accumulation 4 --delay-update --steps 5 --warmup 3}"
    : "${AUTO_ARGS:=--n-embd 4096 --n-layer 8 --device-memory 24GB}"
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
t_tests=${T_TESTS:-420} t_bench=${T_BENCH:-300}
run() {  # name limit command...
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date +%T), limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc $rc in $((SECONDS - t0)) s"
    tail -n "${TAIL:-25}" "$out/$name.log"
}
for part in $parts; do
    case $part in
    env) run env "${T_ENV:-60}" bash -c 'nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), transformers.__version__, torch.cuda.nccl.version())"; nproc; free -g; which g++ ninja nvcc' ;;
    tests) run tests "$t_tests" python3 -m pytest -q -n "${WORKERS:-6}" --dist loadfile -p no:cacheprovider \
               --timeout "${T_TEST:-400}" -rfE --junitxml "$out/tests.xml" ${TESTS:-tests} ;;
    syncs) run syncs "${T_SYNCS:-$t_bench}" python3 bench/gpu_syncs.py --json "$out/syncs.json" ;;
    offload*) args=${part^^}_ARGS; run "$part" "${T_OFFLOAD:-$t_bench}" python3 bench/offload_gpt2.py --json "$out/$part.json" ${!args:-} ;;
    auto*) args=${part^^}_ARGS; run "$part" "${T_AUTO:-$t_bench}" python3 bench/auto_gpt2.py --json "$out/$part.json" ${!args:-} ;;
    ladder) run ladder "$t_bench" python3 bench/run_all.py --only gpu --out "$out/run_all" ${LADDER_ARGS:-} ;;
    *) echo "unknown part $part"; exit 2 ;;
    esac
done
