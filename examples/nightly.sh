#!/bin/sh
# A scheduled `distill run` whose run name survives retries; cron, systemd and Kubernetes call it
# (examples/README.md).
#
#   nightly.sh STATE_FILE DISTILL [distill run arguments...]
#
# The run name, nightly-<date the run started>, is kept in STATE_FILE until that run ends. A run that failed
# (exit 1) or was interrupted (exit 130) keeps its name, so the next start continues the same run folder,
# whether it is a retry a few minutes later, one after midnight, or the next night's start: finished stages
# are skipped and training resumes from last.ckpt. After exit 0 (done) or 2 (bad config, or the publish gate
# refused the draft: retrying cannot help) the file is removed and the next start begins a fresh run.
# To give up on a failing run, delete STATE_FILE. Exits with distill's exit code.
set -u
if [ $# -lt 2 ]; then
    echo "usage: $0 STATE_FILE DISTILL [distill run arguments...]" >&2
    exit 2
fi
state=$1
distill=$2
shift 2

run=$(cat "$state" 2>/dev/null || true)
if [ -z "$run" ]; then
    run=nightly-$(date +%F)
    mkdir -p "$(dirname "$state")" || exit 1
    # Written whole or not at all: a half-written name would start a stray run folder.
    printf '%s\n' "$run" >"$state.tmp" && mv -f "$state.tmp" "$state" || exit 1
fi

"$distill" run "$@" run.name="$run"
rc=$?
case $rc in
    1 | 130) ;; # failed or interrupted: keep the name, the next start resumes this run
    *) rm -f "$state" ;;
esac
exit "$rc"
