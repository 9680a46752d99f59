#!/bin/sh
# Runs a command in a fresh network namespace whose loopback limits every
# TCP flow the way clouds do: each connection gets its own htb class of
# RATE (default 200mbit), picked by a u32 hash on the destination port
# (for the data a peer sends, the receiver's ephemeral port), with the
# ephemeral ports narrowed to 64 so that no two connections share a class.
# (fq and the flow classifier need not be in the kernel; htb and u32 must.)
# Needs root. BENCHMARKS.md, "tcp lanes under a per-flow cap":
#   sudo sh scripts/flowcap.sh ./build/llmdd bench -t tcp --block-size 64M \
#       --blocks 1 --iters 5 --warmup 1 --lanes 4
set -e
RATE=${RATE:-200mbit}
NS=llmddcap$$
TC=$(mktemp)
ip netns add "$NS"
trap 'ip netns delete "$NS"; rm -f "$TC"' EXIT
ip -n "$NS" link set lo up
ip netns exec "$NS" sysctl -qw net.ipv4.ip_local_port_range="40000 40063"
{
    echo "qdisc add dev lo root handle 1: htb default 1"
    echo "class add dev lo parent 1: classid 1:1 htb rate 10gbit quantum 60000"
    echo "filter add dev lo parent 1: prio 1 handle 2: protocol ip u32 divisor 64"
    echo "filter add dev lo parent 1: prio 1 protocol ip u32 ht 800:: match ip protocol 6 0xff hashkey mask 0x0000003f at 20 link 2:"
    i=0
    while [ $i -lt 64 ]; do
        printf 'class add dev lo parent 1: classid 1:%x htb rate %s quantum 60000\n' $((256 + i)) "$RATE"
        printf 'filter add dev lo parent 1: prio 1 protocol ip u32 ht 2:%x: match u32 0 0 flowid 1:%x\n' $i $((256 + i))
        i=$((i + 1))
    done
} > "$TC"
tc -n "$NS" -batch "$TC"
ip netns exec "$NS" "$@"
