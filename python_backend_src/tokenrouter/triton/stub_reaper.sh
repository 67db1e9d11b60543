#!/bin/sh
# Reaper of one Triton Python stub (tokenrouter.triton.stub_guard.start_reaper starts it).
#
#   stub_reaper.sh SERVER SERVER_START STUB STUB_START REGION TMPDIR GRACE
#
# SERVER/STUB: pids; *_START: their start times (field 22 of /proc/PID/stat), so that a
# recycled pid is never taken for either; REGION: the stub's /dev/shm region ("" if none);
# GRACE: whole seconds.  Once a second it reads the stub's /proc/STUB/stat (a zombie, killed
# and not yet reaped, counts as gone):
#   * the stub is gone: remove its ipc sockets (TMPDIR/tokenrouter-STUB-*, left by a
#     SIGKILL); while its region is still there and the server alive, wait (a killed
#     stub's region outlives it until its instance unloads, which may never happen); when
#     the server is gone, also remove what the server left (below); exit;
#   * the stub's parent is no longer SERVER (the server died): wait up to GRACE seconds
#     (polled once a second) for the stub's own clean-up; if it is still there (hung in
#     the Python backend's C++ code with the GIL held), SIGKILL it; either way remove its
#     region, its sockets and the server's files (TMPDIR/tokenrouter-SERVER-*: adverts and locks;
#     tokenrouter-lockstep-SERVER-* turn files in /dev/shm or TMPDIR); exit.
set -f
trap '' INT TERM HUP
s=$1 s_born=$2 me=$3 born=$4 region=$5 tmp=$6 grace=$7

# fields after "pid (comm) ": $1 state, $2 ppid, ..., ${20} start time (comm may hold spaces)
probe() {
    read -r line < "/proc/$1/stat" 2>/dev/null || return 1
    line=${line##*) }
    set -- $line
    state=$1 ppid=$2 start=${20}
}
stub_alive() { probe "$me" && [ "$start" = "$born" ] && [ "$state" != Z ]; }
server_alive() { probe "$s" && [ "$start" = "$s_born" ] && [ "$state" != Z ]; }
server_files() {
    set +f
    [ -n "$region" ] && rm -f "$region"
    rm -f "$tmp/tokenrouter-$s-"* "/dev/shm/tokenrouter-lockstep-$s-"* "$tmp/tokenrouter-lockstep-$s-"*
}

while stub_alive && [ "$ppid" = "$s" ]; do sleep 1 || exit 1; done
if ! stub_alive; then
    (set +f; rm -f "$tmp/tokenrouter-$me-"*)
    # A stub that was unloaded has its region removed by the server at once.  A killed
    # stub's region stays while its instance cannot finish unloading (a BLS request still
    # waits on it), and a server that then exits on its exit timeout never removes it:
    # watch until the region is gone or the server is.
    while [ -n "$region" ] && [ -e "$region" ] && server_alive; do sleep 1 || exit 1; done
    server_alive || server_files
    exit 0
fi
# the grace period, polled: a stub that cleans up and exits frees its reaper at once
i=0
while [ "$i" -lt "$grace" ]; do
    stub_alive || { server_files; exit 0; }
    sleep 1 || exit 1
    i=$((i + 1))
done
stub_alive || { server_files; exit 0; }
kill -9 "$me"
(set +f; rm -f "$tmp/tokenrouter-$me-"*)
server_files
