# shellcheck shell=bash
# TokenRouter on Triton -- environment for the server, the tests and the tools.
#
#   source deploy/env.sh
#
# Sourceable, idempotent and silent when everything is in place. On first use it
# creates a virtual environment from deploy/requirements.txt and
# deploy/requirements-nodeps.txt (and the tasks of perf/quality.py, deploy/requirements-tasks.txt;
# structured output, deploy/requirements-structured.txt) under
#   ${TOKENROUTER_CACHE:-$HOME/.cache/tokenrouter}/venv-<hash>
# where <hash> covers the requirement files (without comments) and the Python build, so fresh clones
# (CI) reuse it. Creation is serialised with flock and marked complete by a file
# written last; a half-built venv is rebuilt.
#
# Inputs (all optional): TOKENROUTER_CACHE, TOKENROUTER_WEIGHTS, TOKENROUTER_PYTHON
# (the base interpreter, default python3), TRITONSERVER (a tritonserver binary to
# use instead of the one found on PATH / in the nvidia-pytriton wheel).
#
# Exports: VIRTUAL_ENV PATH TOKENROUTER_ROOT TOKENROUTER_SRC TOKENROUTER_CACHE
# TOKENROUTER_WEIGHTS TOKENROUTER_VENV TOKENROUTER_PY_VERSION TOKENROUTER_TOOLS_LIB
# TOKENROUTER_TRITON_PYTHON_BACKEND LD_LIBRARY_PATH TRITONSERVER TRITON_BACKEND_DIR
# HF_HUB_OFFLINE (default 1) and SGLANG_USE_CPU_ENGINE=1 when no GPU. It points the venv's
# tokenrouter and scheduler_model at this checkout (site-packages/tokenrouter-checkout.pth).
#
# It never turns on set -e/-u in the calling shell and works under them.

if [[ "${BASH_SOURCE[0]}" == "${0}" ]]; then
    echo "deploy/env.sh must be sourced: source ${0}" >&2
    exit 2
fi

_tr_err() { echo "tokenrouter env: error: $*" >&2; }
_tr_say() { echo "tokenrouter env: $*" >&2; }

# Prepend $2.. (in order) to the colon list named $1, dropping earlier copies.
_tr_prepend_path() {
    local name=$1; shift
    local cur="${!name:-}" out="" d p
    local -a parts
    IFS=: read -r -a parts <<<"$cur"
    for p in "${parts[@]}"; do
        [[ -z "$p" ]] && continue
        for d in "$@"; do [[ "$p" == "$d" ]] && continue 2; done
        out="${out:+$out:}$p"
    done
    local pre=""
    for d in "$@"; do pre="${pre:+$pre:}$d"; done
    printf -v "$name" '%s' "$pre${out:+:$out}"
    export "${name?}"
}

# Symlinks under plain sonames for libraries that nvidia-pytriton ships under
# hashed names (needed by perf_analyzer from tritonclient 2.50.0).
_tr_tools_lib() {
    local libs=$1 tools=$2 soname pattern f
    mkdir -p "$tools" || return 1
    for soname in libb64.so.0d libcudart.so.12; do
        case $soname in
            libb64.so.0d) pattern="libb64-*.so.0d" ;;
            libcudart.so.12) pattern="libcudart-*.so.12*" ;;
        esac
        f=$(compgen -G "$libs/$pattern" | head -n 1)
        if [[ -z "$f" ]]; then
            _tr_err "no $pattern in $libs (nvidia-pytriton layout changed?)"
            return 1
        fi
        ln -sfn "$f" "$tools/$soname" || return 1
    done
}

# Make this checkout's packages (tokenrouter, scheduler_model; see pyproject.toml) the
# venv's, as an editable install does: a .pth file in site-packages naming their folders.
# Python reads it at start-up, also in the isolated interpreter of a Triton stub (which
# ignores PYTHONPATH). The venv is shared by every checkout with the same requirements, so
# the file is rewritten (atomically) whenever another checkout was the last to source this.
_tr_link_checkout() {
    local sp=$1 root=$2 pth="$1/tokenrouter-checkout.pth" want
    # the last line: any script of the environment can import torchvision (and so transformers'
    # model classes) beside the CPU torch (tokenrouter/torchvision_compat.py)
    want=$(printf '%s\n' "$root/python_backend_src" "$root" \
        "import tokenrouter.torchvision_compat as _tr; _tr.install_hook()")
    [[ -f "$pth" && "$(<"$pth")" == "$want" ]] && return 0
    printf '%s\n' "$want" >"$pth.$$.tmp" && mv -f "$pth.$$.tmp" "$pth" || {
        _tr_err "cannot write $pth"
        return 1
    }
}

_tr_build_venv() {
    local py=$1 venv=$2 root=$3 log=$4
    local t0=$SECONDS
    _tr_say "creating the Python environment $venv (once; a few minutes; log: $log)"
    rm -rf "$venv"
    {
        "$py" -m venv "$venv" &&
        "$venv/bin/python" -m pip install --no-input --progress-bar off \
            -r "$root/deploy/requirements.txt" &&
        "$venv/bin/python" -m pip install --no-input --progress-bar off --no-deps \
            -r "$root/deploy/requirements-nodeps.txt" &&
        "$venv/bin/python" -m pip install --no-input --progress-bar off --no-deps --only-binary :all: \
            --require-hashes -r "$root/deploy/requirements-tasks.txt" &&
        "$venv/bin/python" -m pip install --no-input --progress-bar off --no-deps --only-binary :all: \
            --require-hashes -r "$root/deploy/requirements-structured.txt"
    } >"$log" 2>&1 || {
        _tr_err "building the venv failed; last lines of $log:"
        tail -n 30 "$log" >&2
        return 1
    }
    local sp
    sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    _tr_tools_lib "$sp/nvidia_pytriton.libs" "$venv/tokenrouter-tools/lib" || return 1
    date -u +%FT%TZ >"$venv/.tokenrouter-complete" || return 1
    _tr_say "environment ready in $((SECONDS - t0)) s"
}

_tr_env_main() {
    local here root cache py
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P) || return 1
    root=$(dirname "$here")
    cache=${TOKENROUTER_CACHE:-$HOME/.cache/tokenrouter}
    py=${TOKENROUTER_PYTHON:-python3}

    if ! command -v "$py" >/dev/null 2>&1; then
        _tr_err "Python interpreter '$py' not found (set TOKENROUTER_PYTHON)"
        return 1
    fi
    local f
    for f in "$root/deploy/requirements.txt" "$root/deploy/requirements-nodeps.txt" \
        "$root/deploy/requirements-tasks.txt" "$root/deploy/requirements-structured.txt"; do
        [[ -r "$f" ]] || { _tr_err "missing $f"; return 1; }
    done

    # One interpreter call: identity of the Python build, its LIBDIR (holds the
    # libpython the Triton stub must load) and major.minor (selects the stub).
    local -a pyinfo
    mapfile -t pyinfo < <("$py" -c '
import sys, sysconfig
print(sysconfig.get_config_var("LIBDIR") or "")
print("%d.%d" % sys.version_info[:2])
print(sys.version.replace("\n", " "), sys.base_prefix, sysconfig.get_platform())
') || true
    if [[ ${#pyinfo[@]} -ne 3 ]]; then
        _tr_err "could not query '$py'"
        return 1
    fi
    local libdir=${pyinfo[0]} pyver=${pyinfo[1]} pyid=${pyinfo[2]}

    local hash
    # the requirements themselves, not their comments: editing a comment does not rebuild the venv
    hash=$( { sed -e 's/[[:space:]]*#.*//' -e '/^[[:space:]]*$/d' "$root/deploy/requirements.txt" \
        "$root/deploy/requirements-nodeps.txt" "$root/deploy/requirements-tasks.txt" \
        "$root/deploy/requirements-structured.txt"; echo "$pyid"; } | sha256sum | cut -c1-12) || return 1
    local venv="$cache/venv-$hash"

    mkdir -p "$cache" || { _tr_err "cannot create $cache"; return 1; }
    cache=$(cd "$cache" && pwd -P) || return 1
    venv="$cache/venv-$hash"

    if [[ ! -f "$venv/.tokenrouter-complete" ]]; then
        if ! command -v flock >/dev/null 2>&1; then
            _tr_err "flock (util-linux) is required"
            return 1
        fi
        local lockfd
        exec {lockfd}>"$cache/venv-$hash.lock" || return 1
        if ! flock -n "$lockfd"; then
            _tr_say "another process is building $venv; waiting for it"
            flock "$lockfd" || { exec {lockfd}>&-; return 1; }
        fi
        local rc=0
        if [[ ! -f "$venv/.tokenrouter-complete" ]]; then
            _tr_build_venv "$py" "$venv" "$root" "$cache/venv-$hash.log" || rc=1
        fi
        exec {lockfd}>&-
        [[ $rc -eq 0 ]] || return 1
    fi

    local sp="$venv/lib/python$pyver/site-packages"
    local libs="$sp/nvidia_pytriton.libs"
    local tools="$venv/tokenrouter-tools/lib"
    if [[ ! -e "$tools/libb64.so.0d" || ! -e "$tools/libcudart.so.12" ]]; then
        _tr_tools_lib "$libs" "$tools" || return 1
    fi

    export TOKENROUTER_ROOT="$root"
    export TOKENROUTER_SRC="$root/python_backend_src"
    export TOKENROUTER_CACHE="$cache"
    export TOKENROUTER_WEIGHTS="${TOKENROUTER_WEIGHTS:-$cache/weights}"
    export TOKENROUTER_VENV="$venv"
    export TOKENROUTER_PY_VERSION="$pyver"
    export TOKENROUTER_TOOLS_LIB="$tools"
    export VIRTUAL_ENV="$venv"
    unset PYTHONHOME
    _tr_prepend_path PATH "$venv/bin"
    _tr_prepend_path LD_LIBRARY_PATH "$libdir" "$libs" "$tools"
    _tr_link_checkout "$sp" "$root" || return 1

    # tritonserver: an explicit $TRITONSERVER, else one on PATH (NGC container),
    # else the binary inside the nvidia-pytriton wheel.
    local ts="" pybackend=""
    if [[ -n "${TRITONSERVER:-}" && -x "${TRITONSERVER}" && "${TRITONSERVER}" != "$cache"/venv-*/* ]]; then
        ts=$TRITONSERVER
    elif command -v tritonserver >/dev/null 2>&1; then
        ts=$(command -v tritonserver)
    else
        ts="$sp/pytriton/tritonserver/bin/tritonserver"
    fi
    if [[ ! -x "$ts" ]]; then
        _tr_err "tritonserver not found (looked at \$TRITONSERVER, PATH and $ts)"
        return 1
    fi
    export TRITONSERVER="$ts"
    # The python backend that matches that server: <prefix>/backends/python.
    pybackend="$(dirname "$(dirname "$ts")")/backends/python"
    if [[ ! -f "$pybackend/libtriton_python.so" ]]; then
        _tr_err "no libtriton_python.so next to $ts (expected $pybackend)"
        return 1
    fi
    export TOKENROUTER_TRITON_PYTHON_BACKEND="$pybackend"

    # Assembled by deploy/assemble_backends.sh; one per (venv, server, checkout).
    local bhash
    bhash=$(printf '%s\n' "$hash" "$ts" "$root" | sha256sum | cut -c1-12) || return 1
    export TRITON_BACKEND_DIR="$cache/backends-$bhash"

    export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
    if ! nvidia-smi -L >/dev/null 2>&1; then
        export SGLANG_USE_CPU_ENGINE="${SGLANG_USE_CPU_ENGINE:-1}"
    fi
    return 0
}

_tr_rc=0
_tr_env_main || _tr_rc=$?
unset -f _tr_env_main _tr_build_venv _tr_link_checkout _tr_tools_lib _tr_prepend_path _tr_say _tr_err
if [[ $_tr_rc -ne 0 ]]; then
    unset _tr_rc
    return 1
fi
unset _tr_rc
