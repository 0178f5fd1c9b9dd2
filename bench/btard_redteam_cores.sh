#!/bin/bash
# The BTARD red-team bench on N cores at once: one `phalanx bench btard-redteam --preset full` process per core,
# disjoint seed ranges (S = FIRST + 10000 k), MIN minutes each; prints each process's line and the totals.
# Usage: bash bench/btard_redteam_cores.sh MIN N [FIRST] [OUT]   (session 19 ran it with 16 cores on a lent machine,
# after installing blake3, cryptography, cffi, pycparser and dill from wheels; name N: `nproc` said 1 there).
set -u
MIN=${1:?minutes}; N=${2:?processes}; FIRST=${3:-100000}; OUT=${4:-/tmp/btard-redteam-cores}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
for k in $(seq 0 $((N - 1))); do
  python3 -m phalanx.cli bench btard-redteam --preset full --set trials=1 --set first_seed=$((FIRST + k * 10000)) --set minutes="$MIN" \
    --out "$OUT/rt$k" > "$OUT/rt$k.log" 2>&1 &
done
wait
grep -h "trials (seeds" "$OUT"/rt*.log
echo "violations: $(cat "$OUT"/rt*.log | grep -c '^VIOLATION')"
grep -h "trials (seeds" "$OUT"/rt*.log | awk '{t += $1; sub(/.*CPU /, ""); c += $1} END {print "total trials:", t, " total CPU s:", c}'
