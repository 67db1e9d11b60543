# shellcheck shell=bash
# BASH_ENV of a tritonserver that runs on jemalloc (tokenrouter/tools/allocator.py). Triton's Python
# backend starts each model stub with `bash -c "exec triton_python_backend_stub ..."`; bash reads this
# file first, so the stub gets back the LD_PRELOAD, MALLOC_CONF and BASH_ENV it would have had without
# jemalloc, and keeps glibc's malloc (its heap settings and probes are glibc's).
if [[ -n ${TOKENROUTER_STUB_LD_PRELOAD+set} ]]; then
    for _tr_var in LD_PRELOAD MALLOC_CONF BASH_ENV; do
        _tr_saved="TOKENROUTER_STUB_$_tr_var"
        if [[ -n ${!_tr_saved} ]]; then
            export "$_tr_var=${!_tr_saved}"
        else
            unset "$_tr_var"
        fi
        unset "$_tr_saved"
    done
    unset _tr_var _tr_saved
    if [[ -n ${BASH_ENV:-} && -r $BASH_ENV ]]; then
        # shellcheck disable=SC1090
        source "$BASH_ENV"
    fi
fi
