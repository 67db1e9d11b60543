#!/usr/bin/env bash
# Assemble the Triton backend directory TokenRouter runs with ($TRITON_BACKEND_DIR,
# computed by deploy/env.sh: $TOKENROUTER_CACHE/backends-<hash>):
#
#   python/       the python backend that matches $TRITONSERVER (libtriton_python.so,
#                 triton_python_backend_utils.py) plus the stub built for the venv's
#                 Python version (triton_python_backend_stub).
#   <name>/       one symlink per Python-based backend of this checkout,
#                 backends/<name>/ with a model.py (e.g. tokenrouter/). A model selects
#                 it with `backend: "<name>"`; Triton then loads
#                 <backend-dir>/python/libtriton_python.so and runs
#                 <backend-dir>/<name>/model.py (as vllm_backend does).
#
# Idempotent: python/ is built once (in a temp dir, renamed into place); the
# symlinks are refreshed on every run. Prints the directory on stdout.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
# shellcheck source=deploy/env.sh
source "$here/env.sh"

die() { echo "assemble_backends: error: $*" >&2; exit 1; }

out=$TRITON_BACKEND_DIR
src=$TOKENROUTER_TRITON_PYTHON_BACKEND
mkdir -p "$out"

if [[ ! -f "$out/python/.tokenrouter-complete" ]]; then
    # Stub for this Python: the nvidia-pytriton wheel ships one per version next to
    # its server (pytriton/tritonserver/python_backend_stubs/<X.Y>/); an NGC-style
    # install has a single stub inside backends/python/ (built for its own Python).
    stub="$(dirname "$(dirname "$src")")/python_backend_stubs/$TOKENROUTER_PY_VERSION/triton_python_backend_stub"
    if [[ ! -x "$stub" ]]; then
        if [[ -x "$src/triton_python_backend_stub" ]]; then
            stub="$src/triton_python_backend_stub"
            echo "assemble_backends: warning: using $stub; it must be built for Python $TOKENROUTER_PY_VERSION" >&2
        else
            die "no triton_python_backend_stub for Python $TOKENROUTER_PY_VERSION (looked in $stub and $src)"
        fi
    fi
    tmp=$(mktemp -d "$out/.tmp-python-XXXXXX")
    chmod 0755 "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    # Regular files only (no __pycache__).
    find "$src" -maxdepth 1 -type f -exec cp -p {} "$tmp/" \;
    [[ -f "$tmp/libtriton_python.so" ]] || die "libtriton_python.so missing in $src"
    cp -p "$stub" "$tmp/triton_python_backend_stub"
    chmod 0755 "$tmp/triton_python_backend_stub"
    date -u +%FT%TZ >"$tmp/.tokenrouter-complete"
    rm -rf "$out/python"
    mv -T "$tmp" "$out/python"
    trap - EXIT
fi

# Python-based backends of this checkout: refresh links, drop stale ones.
for link in "$out"/*; do
    [[ -L "$link" ]] || continue
    target=$(readlink "$link")
    if [[ ! -f "$target/model.py" ]]; then
        rm -f "$link"
    fi
done
found=0
if [[ -d "$TOKENROUTER_ROOT/backends" ]]; then
    for dir in "$TOKENROUTER_ROOT"/backends/*/; do
        dir=${dir%/}
        [[ -f "$dir/model.py" ]] || continue
        name=$(basename "$dir")
        [[ "$name" == python ]] && die "backends/python would shadow Triton's python backend; rename it"
        ln -sfn "$dir" "$out/$name"
        found=$((found + 1))
    done
fi
if [[ $found -eq 0 ]]; then
    echo "assemble_backends: warning: no backends/<name>/model.py in $TOKENROUTER_ROOT yet" >&2
fi

echo "$out"
