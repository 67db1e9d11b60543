#!/usr/bin/env bash
# Measure TokenRouter with Triton's perf_analyzer (gRPC streaming, decoupled model).
#
#   perf/perf_analyzer.sh [options] [-- extra perf_analyzer args]
#
# Options:
#   -m, --model NAME              default token_router
#   -u, --url HOST:PORT           gRPC endpoint (default localhost:$TOKENROUTER_GRPC_PORT or 8001)
#   -c, --concurrency-range R     START:END:STEP (default 1:4:1)
#   -i, --input-data FILE         default perf/perf_input.json (text_input, stream,
#                                 sampling_parameters)
#   -p, --measurement-interval MS default 20000 (LLM requests are slow on a CPU)
#   -f, --csv FILE                also write perf_analyzer's CSV report
#   -h, --help
# The server must be running (deploy/serve --background).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
prog=perf/perf_analyzer.sh
usage() { sed -n '2,16s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

opts=$(getopt -o m:u:c:i:p:f:h -n "$prog" \
    -l model:,url:,concurrency-range:,input-data:,measurement-interval:,csv:,help -- "$@") ||
    { usage >&2; exit 2; }
eval set -- "$opts"
model=token_router
url="localhost:${TOKENROUTER_GRPC_PORT:-8001}"
concurrency=1:4:1
input="$root/perf/perf_input.json"
interval=20000
csv=""
while true; do
    case $1 in
        -m | --model) model=$2; shift 2 ;;
        -u | --url) url=$2; shift 2 ;;
        -c | --concurrency-range) concurrency=$2; shift 2 ;;
        -i | --input-data) input=$2; shift 2 ;;
        -p | --measurement-interval) interval=$2; shift 2 ;;
        -f | --csv) csv=$2; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        *) echo "$prog: error: unexpected option $1" >&2; exit 2 ;;
    esac
done
[[ -r $input ]] || { echo "$prog: error: input data $input not readable" >&2; exit 2; }

# shellcheck source=deploy/env.sh
source "$root/deploy/env.sh"
pa=$(bash "$root/perf/setup_perf_analyzer.sh")

args=(
    -m "$model" -u "$url" -i grpc --streaming
    --input-data "$input"
    --concurrency-range "$concurrency"
    --measurement-interval "$interval"
)
[[ -n $csv ]] && args+=(-f "$csv")
echo "+ perf_analyzer ${args[*]} $*" >&2
exec "$pa" "${args[@]}" "$@"
