#!/bin/bash
# Run the whole suite (`make test`, the README's test command) N times in a row on a clean clone of HEAD and
# log each run's exit code, time, load and summary line: the flake check of docs/reliability.md. Run it beside
# the load to test under (e.g. two `python3 -c "while True: pass"`, or a 2-worker training).
#
#   scripts/suite_repeat.sh [N] [LOG]      # default 10 runs, log to suite_repeat.txt in the current directory
set -uo pipefail
N=${1:-10}
LOG=$(realpath -m "${2:-suite_repeat.txt}")
SRC=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
chmod 755 "$WORK"   # a checkout others can read, as a clone in a home or /work is (mktemp's 0700 is not):
                    # test_without_root_... runs the package as an unprivileged user
git clone -q "$SRC" "$WORK/repo" || exit 1
cd "$WORK/repo"
echo "commit $(git rev-parse --short HEAD); $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; start $(date -u +%FT%TZ)" >> "$LOG"
failed=0
for i in $(seq 1 "$N"); do
  t0=$(date +%s); load=$(cut -d' ' -f1-3 /proc/loadavg)
  make test > "$WORK/run_$i.log" 2>&1; rc=$?
  [ "$rc" = 0 ] || failed=$((failed + 1))
  echo "run $i: rc=$rc $(( $(date +%s) - t0 )) s; load before $load; $(grep -E '[0-9]+ (passed|failed)' "$WORK/run_$i.log" | tail -1)" >> "$LOG"
  [ "$rc" = 0 ] || cp "$WORK/run_$i.log" "$(dirname "$LOG")/suite_repeat_$(git rev-parse --short HEAD)_run_$i.log"
done
echo "end $(date -u +%FT%TZ): $failed of $N failed" >> "$LOG"
rm -rf "$WORK"
[ "$failed" = 0 ]
