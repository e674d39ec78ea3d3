#!/usr/bin/env bash
# Every GPU check of the project in one prepared run (issue 38): the gpu tests, the MoE layer against
# transformers' experts, the whole model against transformers' native MoE classes, in bf16 on one card, and
# upcycling and routing capture with --device cuda against the CPU.
# Writes the GPU sections of BENCHMARKS.md and logs into $OUT (default runs/gpu). Made for a fresh copy of
# the working tree on a lent machine whose image has torch and Triton but not this project's pinned packages:
# wheels in .whl/ (see docs/guides/distributed.md, "On a GPU", for the list) are installed into /tmp/site first.
#     bash bench/gpu.sh            # at most BUDGET seconds (default 590: one device call is at most 600 s)
# Each step runs under its own cap and under what is left of the budget, so a slow step cannot cost the rest
# their time beyond their caps, nor the whole run more than BUDGET.
set -u -o pipefail
OUT=$(mkdir -p "${OUT:-runs/gpu}" && cd "${OUT:-runs/gpu}" && pwd)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
rc=0
cap() { local left=$(( ${BUDGET:-590} - SECONDS )); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
timeout "$(cap 260)" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_experts.py 2>&1 \
  | tee "$OUT/tests.log" | tail -25 || rc=1
(cd bench && timeout "$(cap 180)" python3 moe_layer.py --tokens 16384 --repeats 15 --decode-repeats 100 --device cuda \
  --dtype bfloat16 --write ../BENCHMARKS.md --profile "$OUT" 2>&1 | tee "$OUT/moe_layer.log" | tail -20) || rc=1
(cd bench && timeout "$(cap 150)" python3 model_throughput.py --layers 30 --repeats 3 --batch 16 --seq 512 --new 32 \
  --device cuda --dtype bfloat16 --only-every-layer --qwen3 --qwen3-layers 12 --out "$OUT/mt" --profile "$OUT" \
  --write ../BENCHMARKS.md 2>&1 | tee "$OUT/model_throughput.log" | tail -16) || rc=1
(cd bench && timeout "$(cap 120)" python3 device_speed.py --work /tmp/device_speed --devices cpu cuda --repeats 1 --texts 32 \
  --write ../BENCHMARKS.md 2>&1 | tee "$OUT/device_speed.log" | tail -10) || rc=1
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
exit $rc
