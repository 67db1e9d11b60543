#!/usr/bin/env bash
# The whole benchmark plan in one command: the matrix (table + plots, every mode
# against its baselines), the DTMC-vs-server comparison and the time breakdown,
# all measured on this machine in one run, in steady state (N clients sending back to
# back; warm-up and drain excluded; ~50 min on 2 cores with the defaults).  Extra
# arguments go to bench_matrix.py (e.g. --duration 60, or --full on GPU hosts).
# Results: perf/results/all-<time>/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
# shellcheck source=deploy/env.sh
source "$root/deploy/env.sh"
python "$root/deploy/prepare_weights.py" >/dev/null
bash "$root/deploy/assemble_backends.sh" >/dev/null
out=${TOKENROUTER_RESULTS:-$root/perf/results/all-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
python -u "$root/perf/bench_matrix.py" --out "$out/matrix" "$@"
python -u "$root/perf/dtmc_vs_server.py" --out "$out/dtmc"
python -u "$root/perf/breakdown.py" --out "$out/breakdown"
echo
echo "== results in $out: matrix/results.md (+ PNG plots), dtmc/dtmc_vs_server.md, breakdown/breakdown.md"
