#!/usr/bin/env bash
# Every GPU check of the project in one prepared run (issue 38): the MoE layer against transformers' experts, the
# whole model against transformers' native MoE classes, in bf16 on one card, the gpu tests, and upcycling and
# routing capture with --device cuda against the CPU. The benchmarks come first: two lent runs (2026-11-27 and
# 2026-11-29) spent their whole time in the tests and timed nothing.
# Writes the GPU sections of BENCHMARKS.md and one log per step into $OUT (default runs/gpu). Made for a fresh copy
# of the working tree on a lent machine whose image has torch and Triton but not this project's pinned packages:
# wheels in .whl/ (`make gpu-wheels`; docs/guides/distributed.md, "On a GPU") are installed into /tmp/site first.
#     BUDGET=575 bash bench/gpu.sh     # at most BUDGET seconds (default 575: one device call is at most 600 s)
# Each step runs in its own process group under its own cap and what is left of the budget; a step past its cap
# is killed (SIGKILL, the whole group) and the run goes on without waiting for it, so no step can cost the others
# their time. A failing test is written to $OUT/failures.log as it fails; a test still running after 60 s has
# every thread's stack dumped into tests.log (faulthandler), so a run cut short still says where it stood.
set -u -o pipefail
OUT=$(mkdir -p "${OUT:-runs/gpu}" && cd "${OUT:-runs/gpu}" && pwd)
BUDGET=${BUDGET:-575}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
rc=0
SETSID=$(command -v setsid || true)

step() {  # step NAME CAP COMMAND...: COMMAND's output in $OUT/NAME.log, for at most CAP seconds
  local name=$1 cap=$2 left=$(( BUDGET - SECONDS )) pid t=0
  shift 2
  (( left < cap )) && cap=$left
  if (( cap < 10 )); then echo "== $name: not run, no time left"; rc=1; return; fi
  echo "== $name (at most $cap s, at $SECONDS s)"
  $SETSID "$@" >"$OUT/$name.log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && (( t < cap )); do sleep 1; t=$(( t + 1 )); done
  if kill -0 "$pid" 2>/dev/null; then
    kill -9 -- "-$pid" "$pid" 2>/dev/null
    echo "== $name: killed after $cap s"
    rc=1
  else
    wait "$pid" || rc=1
  fi
  tail -n 25 "$OUT/$name.log"
  cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
}

step moe_layer 195 python3 bench/moe_layer.py --tokens 16384 --repeats 15 --decode-repeats 100 --device cuda \
  --dtype bfloat16 --write BENCHMARKS.md --profile "$OUT"
step model_throughput 140 python3 bench/model_throughput.py --layers 30 --repeats 3 --batch 16 --seq 512 --new 32 \
  --device cuda --dtype bfloat16 --only-every-layer --qwen3 --qwen3-layers 12 --out /tmp/mt --profile "$OUT" \
  --write BENCHMARKS.md
step tests 150 env MOEKIT_TEST_FAILURES="$OUT/failures.log" python3 -m pytest -v -p no:cacheprovider \
  -o faulthandler_timeout=60 --durations=20 -rfE tests/test_gpu.py tests/test_triton_experts.py
step device_speed 70 python3 bench/device_speed.py --work /tmp/device_speed --devices cpu cuda --repeats 1 --texts 32 \
  --write BENCHMARKS.md
echo "== done at $SECONDS s"
exit $rc
