#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for the Slurm tests and the bench (Debian 12, root).
#
#     bash scripts/slurm.sh            # install (once), configure, start; prints the partition name
#     bash scripts/slurm.sh stop       # stop slurmd, slurmctld, munged (state stays)
#     bash scripts/slurm.sh reset      # stop and wipe the Slurm state (job ids restart at 1)
#
# Debian's munge and slurm-wlm packages do not start their daemons here, so this script does:
# munged as the munge user (after creating /run/munge), then slurmctld and slurmd as root.
# SlurmctldHost and NodeName are `hostname -s`, the node line is what `slurmd -C` reports,
# processes are tracked without cgroups (proctrack/linuxproc, task/none), and cores are
# consumable (select/cons_tres, CR_Core) so several 1-CPU jobs share the node.
#
# No accounting (no slurmdbd): submitit polls job states through `sacct`, so a job that dies
# without writing its result (kill -9, OOM, time limit) is never reported and `result()` waits;
# finished jobs and Python exceptions come back fine. A production cluster has accounting; this
# test cluster does not, to stay within the CI budget (docs/cluster.md).
#
# Exit status 3 with one line on stderr when the daemons cannot run here (not root, no apt, ...):
# the tests skip with that line.
set -euo pipefail

PARTITION=${SWEEP_SLURM_PARTITION:-debug}
CONF=/etc/slurm/slurm.conf
STATE=/var/lib/slurm
say() { echo "slurm.sh: $*" >&2; }
cannot() { echo "slurm.sh: cannot run Slurm here: $*" >&2; exit 3; }

stop_daemons() {
    for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
        if [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
            kill "$(cat "$pidfile")"
            for _ in $(seq 50); do kill -0 "$(cat "$pidfile")" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$pidfile"
    done
}

case "${1:-start}" in
    stop) stop_daemons; exit 0 ;;
    reset) stop_daemons; rm -rf "$STATE/slurmctld" "$STATE/slurmd"; exit 0 ;;
    start) ;;
    *) echo "usage: slurm.sh [start|stop|reset]" >&2; exit 2 ;;
esac

[[ $(id -u) -eq 0 ]] || cannot "the daemons need root (running as $(id -un))"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || cannot "no apt-get to install munge and slurm-wlm"
    say "installing Debian's munge and slurm-wlm"
    export DEBIAN_FRONTEND=noninteractive
    pkgs=(munge slurm-wlm)
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null; } \
        || cannot "apt-get install munge slurm-wlm failed"
fi

# munge: the key (the package creates one; make sure), its runtime dir, the daemon.
if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n </dev/null >/dev/null 2>&1; then
    runuser -u munge -- munged || cannot "munged did not start (see /var/log/munge/munged.log)"
    for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
fi

HOST=$(hostname -s)
NODE_LINE=$(slurmd -C | head -n 1)   # NodeName=<host> CPUs=.. Boards=.. SocketsPerBoard=.. RealMemory=..
mkdir -p /etc/slurm "$STATE/slurmctld" "$STATE/slurmd" /var/log/slurm
new_conf=$(cat <<EOF
# Written by scripts/slurm.sh: one node, no cgroups, no accounting.
ClusterName=ditsweep
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
$NODE_LINE State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
)
if [[ ! -f $CONF ]] || [[ "$(cat $CONF)" != "$new_conf" ]]; then
    echo "$new_conf" > "$CONF"
    [[ -f /run/slurmctld.pid ]] && stop_daemons && runuser -u munge -- munged  # restart on a new config
fi

if ! scontrol ping 2>/dev/null | grep -q "is UP"; then
    slurmctld || cannot "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
fi
if ! { [[ -f /run/slurmd.pid ]] && kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null; }; then
    slurmd || cannot "slurmd did not start (see /var/log/slurm/slurmd.log)"
fi
for _ in $(seq 100); do
    state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
    [[ $state == idle* || $state == mix* || $state == alloc* ]] && break
    [[ $state == down* || $state == drain* ]] && scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
    sleep 0.2
done
[[ $state == idle* || $state == mix* || $state == alloc* ]] || cannot "node $HOST is '${state:-unknown}', not idle (see /var/log/slurm/)"
echo "$PARTITION"
