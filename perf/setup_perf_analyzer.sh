#!/usr/bin/env bash
# Set up Triton's perf_analyzer (C++ binary from the tritonclient 2.50.0 wheel; newer
# wheels no longer carry it) and print its path on stdout:
#
#   PERF_ANALYZER=$(perf/setup_perf_analyzer.sh)      or
#   eval "$(perf/setup_perf_analyzer.sh --export)"    (exports PERF_ANALYZER)
#
# The binary needs libb64.so.0d and libcudart.so.12: nvidia-pytriton ships both
# under hashed names; deploy/env.sh links them under the plain sonames into
# $TOKENROUTER_TOOLS_LIB, which is on its LD_LIBRARY_PATH. Run perf_analyzer with
# that environment (perf/perf_analyzer.sh does).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
# shellcheck source=deploy/env.sh
source "$root/deploy/env.sh"

die() { echo "setup_perf_analyzer: error: $*" >&2; exit 1; }

want=2.50.0
pa="$VIRTUAL_ENV/bin/perf_analyzer"
have=$(python -c 'import importlib.metadata as m; print(m.version("tritonclient"))' 2>/dev/null || true)
if [[ $have != "$want" || ! -x $pa ]]; then
    # The venv's tritonclient is another version: take the binary alone from the
    # 2.50.0 wheel, unpacked into the tools folder (leaves the library alone).
    tools_bin="$(dirname "$TOKENROUTER_TOOLS_LIB")/bin"
    pa="$tools_bin/perf_analyzer"
    if [[ ! -x $pa ]]; then
        echo "setup_perf_analyzer: fetching perf_analyzer from tritonclient $want" >&2
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' EXIT
        python -m pip download --quiet --no-deps --only-binary=:all: \
            "tritonclient==$want" -d "$tmp" >&2 || die "pip download tritonclient==$want failed"
        mkdir -p "$tools_bin"
        python - "$tmp" "$pa" <<'PY' || die "could not extract perf_analyzer"
import glob, os, shutil, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "tritonclient-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/data/bin/perf_analyzer"))
    with z.open(name) as src, open(sys.argv[2] + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
os.chmod(sys.argv[2] + ".tmp", 0o755)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
PY
    fi
fi

missing=$(ldd "$pa" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
[[ -z $missing ]] || die "$pa: shared libraries not found: $missing(LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
# (perf_analyzer --help prints the usage but exits 99; --version exits 0.)
"$pa" --version >/dev/null 2>&1 || {
    "$pa" --version 2>&1 | tail -n 5 >&2
    die "$pa does not start"
}

if [[ ${1:-} == --export ]]; then
    printf 'export PERF_ANALYZER=%q\n' "$pa"
else
    echo "$pa"
fi
