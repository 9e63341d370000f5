#!/usr/bin/env bash
# Every GPU check of zeroshard in one go, on a machine with a CUDA device (see README, "On a GPU").
#   bash bench/gpu_session.sh OUT_DIR [part ...]      parts: env tests syncs offload* auto* ladder
# offload<X> / auto<X> take their arguments from <PART>_ARGS (e.g. part offload_dpu: OFFLOAD_DPU_ARGS),
# so one session can run several sizes and settings.
# Each part logs to OUT_DIR/<part>.log (and .json where the script writes one); a part that fails
# or runs past its time limit is reported and the next one still runs.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [part ...]}; shift
parts=${*:-env tests syncs offload auto}
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
    env) run env 60 bash -c 'nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), transformers.__version__, torch.cuda.nccl.version())"; nproc; free -g; which g++ ninja nvcc' ;;
    tests) run tests "$t_tests" python3 -m pytest -q -n "${WORKERS:-6}" --dist loadfile -p no:cacheprovider \
               --timeout "${T_TEST:-400}" -rfE --junitxml "$out/tests.xml" ${TESTS:-tests} ;;
    syncs) run syncs "$t_bench" python3 bench/gpu_syncs.py --json "$out/syncs.json" ;;
    offload*) args=${part^^}_ARGS; run "$part" "$t_bench" python3 bench/offload_gpt2.py --json "$out/$part.json" ${!args:-} ;;
    auto*) args=${part^^}_ARGS; run "$part" "$t_bench" python3 bench/auto_gpt2.py --json "$out/$part.json" ${!args:-} ;;
    ladder) run ladder "$t_bench" python3 bench/run_all.py --only gpu --out "$out/run_all" ${LADDER_ARGS:-} ;;
    *) echo "unknown part $part"; exit 2 ;;
    esac
done
