#!/usr/bin/env bash
# TE-MoE issue #44: controllers on moectl-small-standard over k-hat x eta, trained one after another
# with the shipped settings (300 steps, 16 prompts x 256 new tokens, checkpoint every 5 steps), one
# thread, in the background. Idempotent: run it again after an interruption and each run resumes
# from its newest checkpoint (`moectl options train` resumes by itself); finished runs are skipped.
#
#   nohup bash benchmarks/options_eta_sweep.sh ~/moectl-runs > ~/moectl-runs/sweep.log 2>&1 &
#
# RUNS/corpus is built first if missing (`moectl corpus build`, the reference models' corpus).
# Order: the etas that should reach the paper's 5-10% regime first (TE-MoE Table 3, k-hat = 8).
# A point k8:x0.04 trains with --eta-per-expert 0.04 (a switch charged 0.04 nats per expert it brings
# in: 0.32 when all k-hat = 8 are new) into RUNS/options/std-k8-x0.04.
# MODEL (default models/moectl-small-standard) and TAG (default std) pick the model the controllers
# are trained on: MODEL=models/moectl-small-emo TAG=emo writes RUNS/options/emo-k8-eta0.64.
set -u
MODEL=${MODEL:-models/moectl-small-standard}
TAG=${TAG:-std}
RUNS=${1:?usage: options_eta_sweep.sh RUNS_DIR [k:eta ...]}
shift
POINTS=${*:-k8:0.16 k8:0.32 k8:0.08 k16:0.16 k16:0.32 k16:0.08 k16:0.04}
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
mkdir -p "$RUNS"
if ! ls "$RUNS"/corpus/train.jsonl* >/dev/null 2>&1; then
  moectl corpus build --out "$RUNS/corpus" --cache "$RUNS/cache" --no-progress --json "$RUNS/corpus_stats.json" || exit 1
fi
for point in $POINTS; do
  k=${point%%:*}; k=${k#k}; eta=${point##*:}
  if [ "${eta#x}" != "$eta" ]; then  # k8:x0.04: eta per expert brought in (issue #44 item 2)
    cost=(--eta-per-expert "${eta#x}"); out=$RUNS/options/$TAG-k$k-x${eta#x}
  else
    cost=(--eta "$eta"); out=$RUNS/options/$TAG-k$k-eta$eta
  fi
  [ -d "$out/final" ] && continue
  echo "$(date -Is) start $out"
  moectl options train "$MODEL" --k-hat "$k" "${cost[@]}" --data "$RUNS/corpus" \
    --steps 300 --batch-size 16 --max-new-tokens 256 --save-every 5 --out "$out"
  rc=$?  # before any expansion: "$(date)" in the echo would reset $? to 0
  echo "$(date -Is) end $out rc=$rc"
done
