#!/usr/bin/env bash
# Benchmark token_router with NVIDIA genai-perf (TTFT, inter-token latency,
# tokens/s): Triton KServe gRPC endpoint, vllm_backend conventions, streaming.
#
#   perf/genai_perf.sh [options] [-- extra genai-perf profile args]
#
# Options:
#   -m, --model NAME           default token_router
#   -u, --url HOST:PORT        Triton gRPC endpoint (default localhost:$TOKENROUTER_GRPC_PORT or 8001)
#   -c, --concurrency N        default 1
#   -n, --request-count N      default 16
#   --input-tokens N           mean synthetic prompt length in tokens (default 64)
#   --output-tokens N          output tokens per request (default 32; sent as max_tokens)
#   --tokenizer DIR            default $TOKENROUTER_WEIGHTS/smollm2-135m-instruct
#   --artifact-dir DIR         default $TOKENROUTER_CACHE/genai-perf/artifacts
#   --setup-only               create genai-perf's environment and exit
#   -h, --help
# genai-perf runs from its own virtual environment (its pins differ from the
# serving stack), created on first use under $TOKENROUTER_CACHE/genai-perf/.
# It calls perf_analyzer, taken from the project environment. The server must
# be running (deploy/serve --background).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
prog=perf/genai_perf.sh
usage() { sed -n '2,21s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
die() { echo "$prog: error: $*" >&2; exit 1; }

GENAI_PERF_VERSION=0.0.16

opts=$(getopt -o m:u:c:n:h -n "$prog" \
    -l model:,url:,concurrency:,request-count:,input-tokens:,output-tokens:,tokenizer:,artifact-dir:,setup-only,help \
    -- "$@") || { usage >&2; exit 2; }
eval set -- "$opts"
model=token_router
url="localhost:${TOKENROUTER_GRPC_PORT:-8001}"
concurrency=1
requests=16
input_tokens=64
output_tokens=32
tokenizer=""
artifacts=""
setup_only=0
while true; do
    case $1 in
        -m | --model) model=$2; shift 2 ;;
        -u | --url) url=$2; shift 2 ;;
        -c | --concurrency) concurrency=$2; shift 2 ;;
        -n | --request-count) requests=$2; shift 2 ;;
        --input-tokens) input_tokens=$2; shift 2 ;;
        --output-tokens) output_tokens=$2; shift 2 ;;
        --tokenizer) tokenizer=$2; shift 2 ;;
        --artifact-dir) artifacts=$2; shift 2 ;;
        --setup-only) setup_only=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        *) die "unexpected option $1" ;;
    esac
done
for v in concurrency requests input_tokens output_tokens; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "--${v//_/-} must be a positive integer, got '${!v}'"
done

# shellcheck source=deploy/env.sh
source "$root/deploy/env.sh"

# genai-perf's own environment (flock: one builder at a time; a marker file written last).
gp_home="$TOKENROUTER_CACHE/genai-perf"
gp_venv="$gp_home/venv-$GENAI_PERF_VERSION"
mkdir -p "$gp_home"
if [[ ! -f "$gp_venv/.complete" ]]; then
    exec {lockfd}>"$gp_home/venv.lock"
    flock "$lockfd"
    if [[ ! -f "$gp_venv/.complete" ]]; then
        echo "$prog: creating genai-perf $GENAI_PERF_VERSION's environment in $gp_venv (once; a few minutes)" >&2
        rm -rf "$gp_venv"
        log="$gp_home/venv-$GENAI_PERF_VERSION.log"
        if ! { "${TOKENROUTER_PYTHON:-python3}" -m venv "$gp_venv" &&
               "$gp_venv/bin/python" -m pip install --no-input --progress-bar off \
                   "genai-perf==$GENAI_PERF_VERSION"; } >"$log" 2>&1; then
            tail -n 20 "$log" >&2
            rm -rf "$gp_venv"
            die "installing genai-perf failed (log: $log)"
        fi
        date -u +%FT%TZ >"$gp_venv/.complete"
    fi
    exec {lockfd}>&-
fi
[[ $setup_only == 1 ]] && { echo "$gp_venv/bin/genai-perf"; exit 0; }

# perf_analyzer from the project environment, alone on PATH first (the PyPI
# perf-analyzer that genai-perf pulls in is an empty placeholder).
pa=$(bash "$root/perf/setup_perf_analyzer.sh")
pa_dir="$gp_home/bin"
mkdir -p "$pa_dir"
ln -sfn "$pa" "$pa_dir/perf_analyzer"

tokenizer=${tokenizer:-$TOKENROUTER_WEIGHTS/smollm2-135m-instruct}
[[ -f $tokenizer/tokenizer.json || -f $tokenizer/tokenizer_config.json ]] ||
    die "no tokenizer in $tokenizer (run deploy/serve once, or give --tokenizer)"
artifacts=${artifacts:-$gp_home/artifacts}

args=(
    profile -m "$model" --endpoint-type kserve --backend vllm --streaming -u "$url"
    --tokenizer "$tokenizer"
    --synthetic-input-tokens-mean "$input_tokens" --synthetic-input-tokens-stddev 0
    --output-tokens-mean "$output_tokens" --output-tokens-stddev 0
    --concurrency "$concurrency" --request-count "$requests" --warmup-request-count 0
    --artifact-dir "$artifacts"
)
echo "+ genai-perf ${args[*]} $*" >&2
PATH="$pa_dir:$gp_venv/bin:$PATH" HF_HUB_OFFLINE=1 exec env -u PYTHONPATH -u VIRTUAL_ENV "$gp_venv/bin/genai-perf" "${args[@]}" "$@"
