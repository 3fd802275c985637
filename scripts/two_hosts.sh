#!/usr/bin/env bash
# Runs a 2-process MPI job on two simulated hosts: network namespaces A and B joined by a
# veth pair (link-local 169.254.100.1 and .2), one rank on each, Open MPI's TCP transport
# only, the daemon on B started through an rsh agent that enters B. The ranks share nothing
# but the link, so the path without shared memory is exercised, and the link can be taken
# down under a running job.
#
#   two_hosts.sh run MPIEXEC PROGRAM ARGS...
#       Runs the job (at most TWO_HOSTS_RUN_BOUND_S, 50 s) and passes on its output and
#       mpiexec's exit status.
#   two_hosts.sh link-down MPIEXEC TRAIN ARGS...
#       Starts train with --metrics added, waits until 3 steps are written, takes A's end
#       of the link down and passes only if mpiexec and every process of the job end
#       within LINK_DOWN_BOUND_S (60) seconds, mpiexec non-zero, with "has not completed"
#       on its stderr. Prints when the ranks, mpiexec and the last process went.
#
# Exits 77 (ctest's SKIP_RETURN_CODE), saying why, where namespaces cannot be created (not
# root, no CAP_NET_ADMIN). Traffic stays inside the two namespaces made here; the root
# namespace's interfaces, routes and host name are never touched. Everything made here is
# removed on exit. TWO_HOSTS_MCA adds mpiexec options (e.g. "--mca btl_base_verbose 100").
set -uo pipefail

usage="usage: two_hosts.sh run|link-down MPIEXEC PROGRAM ARGS..."
mode=${1:?$usage}
mpiexec=${2:?$usage}
shift 2
run_bound_s=${TWO_HOSTS_RUN_BOUND_S:-50}
link_down_bound_s=${LINK_DOWN_BOUND_S:-60}

skip() { echo "two_hosts: SKIPPED: $*" >&2; exit 77; }
for tool in ip unshare timeout; do
  command -v "$tool" >/dev/null || skip "'$tool' is not installed"
done

# Names carry this shell's pid so that parallel ctest runs never meet.
ns_a=pipeshard_a_$$ ns_b=pipeshard_b_$$
veth_a=psa$$ veth_b=psb$$  # interface names must stay under 16 characters
subnet=169.254.100.0/24 addr_a=169.254.100.1 addr_b=169.254.100.2
work=$(mktemp -d "${TMPDIR:-/tmp}/2h.XXXXXX") || exit 1

namespace_pids() { ip netns pids "$1" 2>/dev/null; }
cleanup() {
  local ns pid
  disown -a 2>/dev/null  # no "Killed" notices for the background job
  for ns in "$ns_a" "$ns_b"; do
    for pid in $(namespace_pids "$ns"); do kill -KILL "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null  # the veth pair goes with it
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP
trap 'exit 141' PIPE  # output into a closed pipe (| head) must not leave the hosts behind

make_hosts() {
  ip netns add "$ns_a" 2>"$work/err" || skip "cannot create a network namespace: $(cat "$work/err")"
  ip netns add "$ns_b" || return 1
  ip link add "$veth_a" netns "$ns_a" type veth peer name "$veth_b" netns "$ns_b" || return 1
  ip -n "$ns_a" addr add "$addr_a/24" dev "$veth_a" || return 1
  ip -n "$ns_b" addr add "$addr_b/24" dev "$veth_b" || return 1
  local ns dev
  for ns in "$ns_a:$veth_a" "$ns_b:$veth_b"; do
    # No IPv6 on the pair, or Open MPI would also talk over its fe80:: addresses.
    ip netns exec "${ns%:*}" sh -c "echo 1 >/proc/sys/net/ipv6/conf/${ns#*:}/disable_ipv6" 2>/dev/null
    # A connection the link left with data unacknowledged sends no keepalive (see the oob
    # options below): it retransmits, tcp_retries2 times, 15 (~15 min) by default, after
    # which mpiexec would learn the daemon is gone. 5 gives up after ~13 s, close to the
    # keepalive's 10 s. Seen once: the link went down as mpiexec and B's daemon were talking,
    # the ranks ended at 15 s by --comm-timeout, and mpiexec was still waiting at 60 s.
    ip netns exec "${ns%:*}" sh -c "echo 5 >/proc/sys/net/ipv4/tcp_retries2" 2>/dev/null
    for dev in lo "${ns#*:}"; do ip -n "${ns%:*}" link set "$dev" up || return 1; done
  done
  for _ in $(seq 50); do  # a veth has carrier a moment after both ends are up
    ip -n "$ns_a" -br link show "$veth_a" | grep -q " UP " &&
      ip -n "$ns_b" -br link show "$veth_b" | grep -q " UP " && return 0
    sleep 0.1
  done
  echo "two_hosts: the veth pair did not come up" >&2
  return 1
}

# Open MPI's rsh launcher runs AGENT HOST COMMAND... to start its daemon on HOST; this agent
# runs COMMAND inside B. Each host gets a host name of its own (in its own UTS namespace)
# so that messages say nodea/nodeb, and a TMPDIR of its own for Open MPI's session files.
write_agent() {
  mkdir -p "$work/a" "$work/b"
  cat >"$work/rsh_agent" <<EOF
#!/bin/sh
[ "\$1" = "$addr_b" ] || { echo "rsh agent: no host \$1" >&2; exit 255; }
shift
exec ip netns exec "$ns_b" unshare --uts sh -c 'hostname nodeb && export TMPDIR="\$0" && exec sh -c "\$1"' "$work/b" "\$*"
EOF
  chmod +x "$work/rsh_agent"
}

make_hosts || exit 1
write_agent
# btl tcp,self: TCP between the ranks, never vader (shared memory) or openib/ofi. pml ob1:
# pml ucx or cm (mtl ofi/psm) would bring transports of their own, shared memory included.
# if_include: MPI traffic and Open MPI's own (oob) stay on the veth subnet.
# oob keepalive: mpiexec and B's daemon notice within ~10 s that the link is gone, while their
# connection is still idle. It has to come before either queues a message to the other (the
# ranks ending, say): the kernel sends no keepalive with data unacknowledged, only
# retransmissions, which it gives up after tcp_retries2 (~15 min). Measured: with the defaults
# (300 s) or slower than a rank's --comm-timeout, mpiexec was still waiting 90-150 s later.
# TWO_HOSTS_MCA cannot repeat these: mpiexec refuses a parameter given twice.
mca=(--mca plm_rsh_agent "$work/rsh_agent"
     --mca pml ob1 --mca btl tcp,self
     --mca btl_tcp_if_include "$subnet" --mca oob_tcp_if_include "$subnet"
     --mca oob_tcp_keepalive_time 4 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3
     ${TWO_HOSTS_MCA:-})
launch=(ip netns exec "$ns_a" unshare --uts sh -c 'hostname nodea && export TMPDIR="$0" && exec "$@"' "$work/a"
        "$mpiexec" --host "$addr_a:1,$addr_b:1" -np 2 "${mca[@]}")

ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }  # $1 from date +%s%N

# One line "PID COMMAND in NAMESPACE" per process left in either host.
job_processes() {
  local ns pid
  for ns in "$ns_a" "$ns_b"; do
    for pid in $(namespace_pids "$ns"); do echo "$pid $(cat /proc/"$pid"/comm 2>/dev/null) in ${ns%_*}"; done
  done
}

link_down() {
  local steps=$work/steps.jsonl out=$work/stdout err=$work/stderr
  local rank_comm; rank_comm=$(basename "$1" | cut -c1-15)  # as /proc/PID/comm has it
  # Once mpiexec and B's daemon have noticed the loss (~10 s), they stop their ranks: SIGTERM
  # odls_base_sigkill_timeout seconds later (train defers it to the end of a step that never
  # ends), SIGKILL as long again after that. 10 s each way leaves the ranks' own diagnosis
  # (--comm-timeout 15) time to come first; mpiexec then ends ~30 s after the link. Only here:
  # every failed job's teardown takes 20 s longer with it.
  "${launch[@]}" --mca odls_base_sigkill_timeout 10 "$@" --metrics "$steps" >"$out" 2>"$err" &
  local mpiexec_pid=$! start; start=$(date +%s%N)
  until [ "$(cat "$steps" 2>/dev/null | wc -l)" -ge 3 ]; do
    # A failed start shows as mpiexec's banner at once; its teardown may take 20 s more.
    grep -q "non-zero exit code" "$err" && break
    if ! kill -0 "$mpiexec_pid" 2>/dev/null || [ "$(ms_since "$start")" -gt 30000 ]; then break; fi
    sleep 0.1
  done
  if [ "$(cat "$steps" 2>/dev/null | wc -l)" -lt 3 ]; then
    echo "two_hosts: FAILED: training did not get under way"; cat "$out" "$err"; return 1
  fi
  echo "two_hosts: $(wc -l <"$steps") steps done; taking the link down"
  local down; down=$(date +%s%N)
  ip -n "$ns_a" link set "$veth_a" down || return 1
  local status="" mpiexec_ms="" ranks_ms="" all_ms="" ms left
  while :; do
    ms=$(ms_since "$down")
    if [ -z "$status" ] && ! kill -0 "$mpiexec_pid" 2>/dev/null; then
      wait "$mpiexec_pid"; status=$?; mpiexec_ms=$ms
    fi
    left=$(job_processes)
    [ -z "$ranks_ms" ] && ! grep -q " $rank_comm in " <<<"$left" && ranks_ms=$ms
    [ -z "$left" ] && [ -n "$status" ] && { all_ms=$ms; break; }
    if [ "$ms" -gt $((link_down_bound_s * 1000)) ]; then
      echo "two_hosts: still there ${link_down_bound_s} s after the link went down (killed now):"
      ps -o pid,etimes,args -p "$(awk '{print $1}' <<<"$left" | paste -sd,)"
      break
    fi
    sleep 0.2
  done
  echo "two_hosts: after the link went down, the ranks were gone at ${ranks_ms:-never} ms, mpiexec" \
       "exited at ${mpiexec_ms:-never} ms (status ${status:-none}), the last process at ${all_ms:-never} ms"
  echo "--- mpiexec's stdout"; cat "$out"
  echo "--- mpiexec's stderr"; cat "$err"
  echo "---"
  [ -n "$all_ms" ] || { echo "two_hosts: FAILED: the job outlived the link by ${link_down_bound_s} s"; return 1; }
  [ "$status" != 0 ] || { echo "two_hosts: FAILED: mpiexec exited 0 without its link"; return 1; }
  grep -q "has not completed" "$err" || { echo "two_hosts: FAILED: no rank said what 'has not completed'"; return 1; }
  echo "two_hosts: passed: every process ended within ${link_down_bound_s} s, mpiexec with status $status"
}

case "$mode" in
  run) timeout -k 5 "$run_bound_s" "${launch[@]}" "$@" ;;
  link-down) link_down "$@" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
