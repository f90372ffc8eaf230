#!/usr/bin/env bash
# The NIAH grid: each arm runs `kvflash niah` into ROOT/<arm>, then `python -m bench.niah_table` merges
# the arms' summary.json into ROOT/table.md (the table for docs/BENCHMARKS.md). Rerunning resumes.
#
#   bench/niah_grid.sh out/niah                        # the full grid (lengths 2K,4K,8K x 11 depths x 4)
#   LENGTHS=2048,4096 DEPTHS=5 TRIALS=1 ARMS="full qk8 lru8 sink8 restore-qk8" \
#     bench/niah_grid.sh out/niah-small --device cpu   # a small grid; extra flags go to every arm
#
# Env: LENGTHS, DEPTHS, TRIALS, ARMS (a subset of the arms below), KVFLASH (default kvflash), PYTHON.
set -euo pipefail

root=${1:?usage: bench/niah_grid.sh ROOT [kvflash niah flags for every arm]}
shift
KVFLASH=${KVFLASH:-kvflash}
ARMS=${ARMS:-full qk4 qk8 qk8-abs lru8 sink8 restore-full restore-qk8}
grid=(--lengths "${LENGTHS:-2048,4096,8192}" --depths "${DEPTHS:-11}" --trials "${TRIALS:-4}")

arm_flags() {
  case $1 in
    full) echo --policy full ;;
    qk4) echo --policy qk --budget-frac 0.25 ;;
    qk8) echo --policy qk --budget-frac 0.125 ;;
    qk8-abs) echo --policy qk --budget-frac 0.125 --absolute-positions ;;
    lru8) echo --policy lru --budget-frac 0.125 ;;
    sink8) echo --policy sink --budget-frac 0.125 ;;
    restore-full) echo --policy full --mode restore ;;
    restore-qk8) echo --policy qk --budget-frac 0.125 --mode restore ;;
    lazy-qk8) echo --policy qk --budget-frac 0.125 --mode lazy ;;
    lazy-qk8-r8) echo --policy qk --budget-frac 0.125 --mode lazy --scout-reads 8 ;;
    *) echo "unknown arm $1" >&2; return 1 ;;
  esac
}

mkdir -p "$root"
for arm in $ARMS; do
  flags=$(arm_flags "$arm")
  echo "== $arm: $KVFLASH niah $flags ${grid[*]} --out $root/$arm $*"
  start=$(date +%s)
  # shellcheck disable=SC2086  # KVFLASH and flags are word lists
  $KVFLASH niah $flags "${grid[@]}" --out "$root/$arm" "$@"
  echo "$arm $(($(date +%s) - start))" >>"$root/wall_s.txt"
done

summaries=()
for arm in $ARMS; do summaries+=("$root/$arm/summary.json"); done
repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" ${PYTHON:-python} -m bench.niah_table "${summaries[@]}" | tee "$root/table.md"
