#!/usr/bin/env bash
# TokenRouter container entrypoint: render the model repository of this server's role
# and target, then exec tritonserver (PID 1's successor: it gets SIGTERM directly).
# Run `deploy/docker/entrypoint.sh --help`. Works outside a container too (it sources
# deploy/env.sh unless TOKENROUTER_ENV_READY=1 says the environment is already set up,
# as in the GPU image).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
prog="entrypoint"

usage() {
    cat <<EOF
Usage: $prog [options] [-- extra tritonserver args]

Renders the model repository this server hosts (python -m tokenrouter.tools.deployment)
and starts tritonserver on it; the OpenAI-compatible API starts beside it once it is
ready when this server hosts the router. Every option has an environment default.

Role (mirrors deploy/serve):
  --models LIST           models hosted here, e.g. slm,token_router or llm
                          (\$TOKENROUTER_MODELS; default: every model of the repository)
  --remote MODEL=EP[,EP]  a model hosted elsewhere, EP = tcp://HOST:PORT; several EPs
                          are replicas; repeatable (\$TOKENROUTER_REMOTE: specs separated
                          by spaces)
  --remote-models-file F  JSON {model: endpoint | [endpoints]}, e.g. a mounted ConfigMap
                          (\$TOKENROUTER_REMOTE_MODELS_FILE)
  --peer-port N           hosted LLM models listen on tcp://0.0.0.0:N (N+1, ...)
                          (\$TOKENROUTER_PEER_PORT; default: local ipc:// only)
  --keys DIR              CURVE key folder for TCP peers (\$TOKENROUTER_KEYS)
  --no-curve              TCP peers without CURVE (trusted networks only)
Target:
  --target cpu|gpu        (\$TOKENROUTER_TARGET, default cpu) gpu: KIND_GPU instances,
                          device cuda, CUDA graphs on, bfloat16
  --pair demo|size-realistic
                          (\$TOKENROUTER_PAIR, default demo)
  --gpus MODEL=I,...      GPU of each model, gpu target (\$TOKENROUTER_GPUS; default 0)
  --param MODEL.KEY=VALUE any other config parameter; repeatable
  Checkpoints: \$TOKENROUTER_SLM_PATH, \$TOKENROUTER_LLM_PATH (folders, absolute or
  under \$TOKENROUTER_WEIGHTS); the router's tokenizer follows the SLM's.
Server:
  --http-port N --grpc-port N --metrics-port N
                          (\$TOKENROUTER_HTTP_PORT / _GRPC_PORT / _METRICS_PORT: 8000/8001/8002)
  --openai-port N         (\$TOKENROUTER_OPENAI_PORT, default 9000; 0: off; only with the router)
  --repository-out DIR    where the rendered repository goes
                          (\$TOKENROUTER_RUN_REPOSITORY, default \${TMPDIR:-/tmp}/tokenrouter-repository)
  tritonserver's allocator: \$TOKENROUTER_MALLOC auto (default; jemalloc, which the images
                          install, else glibc), jemalloc or glibc (docs/reliability.md)
  --dry-run               print the tritonserver command and the rendered repository; exit 0
  -h, --help              this text
EOF
}

die() { echo "$prog: error: $*" >&2; exit 2; }

opts=$(getopt -o h -n "$prog" \
    -l help,dry-run,no-curve,target:,models:,remote:,remote-models-file:,peer-port:,keys:,pair:,gpus:,param:,http-port:,grpc-port:,metrics-port:,openai-port:,repository-out: \
    -- "$@") || { usage >&2; exit 2; }
eval set -- "$opts"

target=${TOKENROUTER_TARGET:-cpu}
models=${TOKENROUTER_MODELS:-}
read -r -a remotes <<<"${TOKENROUTER_REMOTE:-}"
remote_file=${TOKENROUTER_REMOTE_MODELS_FILE:-}
peer_port=${TOKENROUTER_PEER_PORT:-0}
keys=${TOKENROUTER_KEYS:-}
curve=1
pair=${TOKENROUTER_PAIR:-demo}
gpus=${TOKENROUTER_GPUS:-}
params=()
http_port=${TOKENROUTER_HTTP_PORT:-8000}
grpc_port=${TOKENROUTER_GRPC_PORT:-8001}
metrics_port=${TOKENROUTER_METRICS_PORT:-8002}
openai_port=${TOKENROUTER_OPENAI_PORT:-9000}
repo_out=${TOKENROUTER_RUN_REPOSITORY:-${TMPDIR:-/tmp}/tokenrouter-repository}
dry_run=0
while true; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --dry-run) dry_run=1; shift ;;
        --no-curve) curve=0; shift ;;
        --target) target=$2; shift 2 ;;
        --models) models=$2; shift 2 ;;
        --remote) remotes+=("$2"); shift 2 ;;
        --remote-models-file) remote_file=$2; shift 2 ;;
        --peer-port) peer_port=$2; shift 2 ;;
        --keys) keys=$2; shift 2 ;;
        --pair) pair=$2; shift 2 ;;
        --gpus) gpus=$2; shift 2 ;;
        --param) params+=("$2"); shift 2 ;;
        --http-port) http_port=$2; shift 2 ;;
        --grpc-port) grpc_port=$2; shift 2 ;;
        --metrics-port) metrics_port=$2; shift 2 ;;
        --openai-port) openai_port=$2; shift 2 ;;
        --repository-out) repo_out=$2; shift 2 ;;
        --) shift; break ;;
        *) die "unexpected option $1" ;;
    esac
done
extra_args=("$@")

for v in peer_port http_port grpc_port metrics_port openai_port; do
    [[ ${!v} =~ ^[0-9]+$ ]] || die "--${v//_/-} must be a number, got '${!v}'"
done
case $target in cpu | gpu) ;; *) die "--target must be cpu or gpu, got '$target'" ;; esac

if [[ ${TOKENROUTER_ENV_READY:-0} != 1 ]]; then
    # shellcheck source=deploy/env.sh
    source "$root/deploy/env.sh" || die "could not set up the environment (deploy/env.sh)"
fi
: "${TRITONSERVER:=tritonserver}"
: "${TRITON_BACKEND_DIR:?TRITON_BACKEND_DIR is not set (deploy/env.sh sets it)}"

render_out=$repo_out
if ((dry_run)); then
    # a dry run writes nothing a real run uses: it renders into a folder of its own
    render_out=$(mktemp -d "${TMPDIR:-/tmp}/tokenrouter-dry-run.XXXXXX")
    trap 'rm -rf "$render_out"' EXIT
fi
render_args=(render --src "$root/model_repository" --out "$render_out" --target "$target" --pair "$pair"
    --models "$models" --peer-port "$peer_port")
for r in ${remotes[@]+"${remotes[@]}"}; do render_args+=(--remote "$r"); done
[[ -n $remote_file ]] && render_args+=(--remote-models-file "$remote_file")
[[ -n $keys ]] && render_args+=(--keys "$keys")
((curve)) || render_args+=(--no-curve)
[[ -n $gpus ]] && render_args+=(--gpus "$gpus")
[[ -n ${TOKENROUTER_SLM_PATH:-} ]] && render_args+=(--model-path "slm=$TOKENROUTER_SLM_PATH")
[[ -n ${TOKENROUTER_LLM_PATH:-} ]] && render_args+=(--model-path "llm=$TOKENROUTER_LLM_PATH")
for p in ${params[@]+"${params[@]}"}; do render_args+=(--param "$p"); done

summary=$(python -m tokenrouter.tools.deployment "${render_args[@]}") || exit 2
mapfile -t hosted < <(python -c 'import json, sys; print("\n".join(json.loads(sys.argv[1])["models"]))' "$summary")
has_router=0
for m in "${hosted[@]}"; do [[ $m == token_router ]] && has_router=1; done

server_args=(
    --model-repository "$repo_out"
    --backend-directory "$TRITON_BACKEND_DIR"
    --http-port "$http_port"
    --grpc-port "$grpc_port"
    --metrics-port "$metrics_port"
    --model-load-thread-count 1
    --model-control-mode explicit
    --grpc-infer-allocation-pool-size 0   # as deploy/serve: no pooled request states (docs/reliability.md)
    --disable-auto-complete-config        # as deploy/serve: complete configs, no extra stub per model
)
for m in "${hosted[@]}"; do server_args+=(--load-model "$m"); done
server_args+=(${extra_args[@]+"${extra_args[@]}"})

if ((dry_run)); then
    echo "# summary: $summary"
    printf '# tritonserver command:\n%q' "$TRITONSERVER"
    printf ' %q' "${server_args[@]}"
    printf '\n'
    if ((has_router && openai_port > 0)); then
        echo "# then, once ready: python -m tokenrouter.tools.openai_frontend --triton-url 127.0.0.1:$grpc_port --port $openai_port"
    fi
    echo "# rendered repository (a real run writes it to $repo_out):"
    for m in "${hosted[@]}"; do
        echo "# ---- $m/config.pbtxt"
        cat "$render_out/$m/config.pbtxt"
    done
    exit 0
fi

if [[ -z ${TOKENROUTER_SLM_PATH:-} || -z ${TOKENROUTER_LLM_PATH:-} ]]; then
    python "$root/deploy/prepare_weights.py"              # the demo weights; no-op once they exist
fi
if [[ ${TOKENROUTER_ENV_READY:-0} != 1 ]]; then
    bash "$root/deploy/assemble_backends.sh" >/dev/null   # idempotent
fi

if ((has_router && openai_port > 0)); then
    # After exec, $$ is tritonserver: the front end waits for it to be ready and exits with it.
    (
        python - "$http_port" "$$" <<'PY' || exit 0
import os, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/v2/health/ready"
while True:
    try:
        os.kill(int(sys.argv[2]), 0)  # the server is gone: no front end
    except OSError:
        sys.exit(1)
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
PY
        exec python -m tokenrouter.tools.openai_frontend --triton-url "127.0.0.1:$grpc_port" --port "$openai_port" \
            --exit-with-pid "$$"
    ) &
fi
echo "$prog: tritonserver (target $target, models ${hosted[*]}): $summary" >&2
# as deploy/serve: tritonserver's allocator ($TOKENROUTER_MALLOC, default auto: jemalloc where the image
# has it, else glibc with large buffers unmapped when freed); the model stubs keep glibc's malloc
alloc_env=$(python -m tokenrouter.tools.allocator) || exit 2
mapfile -t server_env <<<"$alloc_env"
exec env "${server_env[@]}" "$TRITONSERVER" "${server_args[@]}"
