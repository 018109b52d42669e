"""`largebatch emulate hosts`: real separate hosts on one machine, made of Linux network namespaces.

Each node is its own network namespace with its own loopback and one Ethernet link
(a veth pair) to a switch (a Linux bridge) that lives in a further namespace of its
own, so nothing is added to the host's root namespace. The links are shaped with
`tc`, and one `torchrun` agent per node runs inside its namespace; the agents meet
through torchrun's c10d rendezvous at node 0's address, exactly as on a real cluster.

    switch namespace  lbc-<id>-sw:   br0 --+-- p0  <== veth ==>  eth0 10.213.0.1   lbc-<id>-n0  (+ lo)
                                           +-- p1  <== veth ==>  eth0 10.213.0.2   lbc-<id>-n1  (+ lo)

Traffic paths. Every worker binds gloo (and NCCL's socket transport) to its node's
`eth0` address (GLOO_SOCKET_IFNAME=eth0). A connection to a peer on another node
leaves through eth0, crosses the shaped veth, the bridge and the peer's shaped veth.
A connection to a peer on the same node goes to an address of the own namespace,
which the kernel routes over the namespace's loopback (the `local` routing table),
so intra-node traffic never touches the shaped link; `tests/integration/test_emulate_hosts.py`
measures both.

Shaping. Each direction of each node's link (egress of eth0 in the node, egress
of p<i> in the switch) gets a token bucket (`tbf`) at --inter-node-gbit and, when
--inter-node-latency-ms > 0, a `netem` delay of half the latency, so a packet from
node a to node b is rate-limited to the configured rate and delayed by the
configured one-way latency. Kernels built without sch_netem (such as this project's
CI container) still get the rate limit; the missing delay is announced once.

Steps (the code of `run_cluster` follows them):
  1. Check: root, `ip` and `tc` present; arguments valid (`parse_args`).
  2. Name: a random 6-hex-digit id, so parallel runs and leftovers never clash.
  3. Switch: namespace lbc-<id>-sw, loopback up, bridge br0 up.
  4. Nodes: namespace lbc-<id>-n<i>, loopback up, a veth pair created inside the
     switch namespace (p<i> on the bridge, eth0 moved into the node), 10.213.0.<i+1>/24.
  5. Shape: tbf (+ netem) on both ends of every node link.
  6. Launch: per node `ip netns exec lbc-<id>-n<i> python -m torch.distributed.run
     --nnodes N --nproc-per-node P --node-rank i --rdzv-backend c10d
     --rdzv-endpoint 10.213.0.1:PORT --local-addr <addr_i> -m largebatch CMD...`,
     each in its own process group, output streamed with a "[node i]" prefix.
  7. Wait: the exit code is the first non-zero agent exit code (or 0); unless
     --keep-going, the first failure stops the other agents. An agent that ended because it lost
     node 0's rendezvous store (launch.EXIT_STORE_LOST) is not that failure: node 0's own code,
     which comes moments later, says why (after STORE_LOST_GRACE_S without it, the others are
     stopped and the code is EXIT_STORE_LOST).
  8. Tear down, always (normal exit, failure, Ctrl-C, SIGTERM, SIGHUP): stop the agent
     process groups (SIGTERM, then SIGKILL after a grace period), kill what is left
     inside the run's namespaces, delete the namespaces (which deletes their links).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from largebatch.cli import ArgumentParser
from largebatch.errors import UserError
from largebatch.launch import EXIT_STORE_LOST

SUBNET = "10.213.0"  # a private /24 that exists only inside the run's namespaces
NODE_IFNAME = "eth0"  # the node's end of its link; the name is local to the node's namespace
MAX_NODES = 200
PREFIX = "lbc-"  # every namespace of every run starts with this
STOP_GRACE_S = 5.0  # between SIGTERM and SIGKILL of the agents
STORE_LOST_GRACE_S = 30.0  # a node that lost node 0's store waits this long for node 0's own exit code


@dataclass(frozen=True)
class ClusterSpec:
    """What `emulate hosts` was asked for, validated."""

    nodes: int
    procs_per_node: int
    gbit: float  # rate of each node's link, each direction
    latency_ms: float  # one-way node-to-node latency added by netem
    port: int  # rendezvous port on node 0 (inside the namespaces, so always free)
    keep_going: bool
    exec_mode: bool  # the command is any program (torchrun --no-python), not a largebatch command
    command: tuple[str, ...]


@dataclass
class Cluster:
    """The names and addresses of one run's namespaces."""

    run_id: str
    nodes: int
    switch: str = field(init=False)
    hosts: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.switch = f"{PREFIX}{self.run_id}-sw"
        self.hosts = [f"{PREFIX}{self.run_id}-n{i}" for i in range(self.nodes)]

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *self.hosts]


# ---------------------------------------------------------------------------------------------
# 1. Check


def parse_args(argv: list[str]) -> ClusterSpec:
    """Parse `emulate hosts` arguments; everything after `--` is the command."""
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1:]
    else:
        own, command = argv, []
    p = ArgumentParser(
        prog="largebatch emulate hosts",
        description="Run a command on N hosts made of network namespaces joined by a shaped switch.",
        epilog="Examples:\n"
        "  largebatch emulate hosts --nodes 2 --procs-per-node 2 -- bench allreduce\n"
        "  largebatch emulate hosts --nodes 2 --procs-per-node 1 --exec -- python my_check.py\n"
        "Needs root and iproute2 (ip, tc).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=2, help="number of hosts (namespaces); default 2")
    p.add_argument("--procs-per-node", type=int, default=1, help="torchrun workers per host; default 1")
    p.add_argument("--inter-node-gbit", type=float, default=1.0,
                   help="rate of each host's link, each direction, in Gbit/s; default 1")
    p.add_argument("--inter-node-latency-ms", type=float, default=0.1,
                   help="one-way latency between two hosts in ms (needs sch_netem); default 0.1")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port on node 0; default 29400")
    p.add_argument("--keep-going", action="store_true",
                   help="let the other hosts run on when one fails (default: stop them all)")
    p.add_argument("--exec", dest="exec_mode", action="store_true",
                   help="the command after -- is any program run under torchrun --no-python "
                        "(a leading 'python' means this interpreter) instead of a largebatch command")
    p.usage = p.format_usage().removeprefix("usage: ").strip() + " -- COMMAND [ARG ...]"   # the command after --
    a = p.parse_args(own)
    if not 1 <= a.nodes <= MAX_NODES:
        raise UserError(f"--nodes {a.nodes} is out of range; give 1 to {MAX_NODES}.")
    if a.procs_per_node < 1:
        raise UserError(f"--procs-per-node {a.procs_per_node} must be at least 1.")
    if not a.inter_node_gbit > 0 or a.inter_node_gbit > 1000:
        raise UserError(f"--inter-node-gbit {a.inter_node_gbit} must be in (0, 1000].")
    if not 0 <= a.inter_node_latency_ms <= 10_000:
        raise UserError(f"--inter-node-latency-ms {a.inter_node_latency_ms} must be in [0, 10000].")
    if not 1024 <= a.port <= 65535:
        raise UserError(f"--port {a.port} must be in 1024..65535.")
    if not command:
        raise UserError("no command given; put it after '--', e.g. "
                        "'largebatch emulate hosts --nodes 2 -- bench allreduce'.")
    _check_command(command, a.exec_mode)
    return ClusterSpec(a.nodes, a.procs_per_node, a.inter_node_gbit, a.inter_node_latency_ms,
                       a.port, a.keep_going, a.exec_mode, tuple(command))


def _check_command(command: list[str], exec_mode: bool) -> None:
    """Before any namespace is made: the program exists (--exec), or the largebatch command is known (an unknown
    one would build the cluster and fail on every node; a missing program gave torchrun's traceback per node)."""
    from largebatch.cli import COMMANDS

    if exec_mode:
        program = command[0]
        if program in ("python", "python3"):
            return
        if shutil.which(program) is None:
            raise UserError(f"--exec program {program!r} is not an executable file or on PATH; give its path "
                            "(or 'python SCRIPT').")
        return
    if " ".join(command[:2]) in COMMANDS or command[0] in COMMANDS:
        return
    choices = [c for c in COMMANDS if c.split()[0] == command[0]] or sorted({c.split()[0] for c in COMMANDS})
    raise UserError(f"{' '.join(command[:2])!r} after '--' is not a largebatch command; give one of: "
                    f"{', '.join(choices)} (or pass --exec to run another program).")


def check_system() -> None:
    """Root and iproute2 are needed to make namespaces; say so in one sentence otherwise."""
    if not sys.platform.startswith("linux"):
        raise UserError("emulate hosts needs Linux network namespaces; run it on Linux.")
    if os.geteuid() != 0:
        raise UserError("emulate hosts needs root to create network namespaces; run it as root (e.g. sudo).")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise UserError(f"emulate hosts needs '{tool}' from iproute2; install it with "
                            "'apt-get install -y iproute2' (or 'make setup').")


def _sh(*cmd: str, ns: str | None = None) -> subprocess.CompletedProcess:
    """Run one iproute2 command (inside namespace `ns`); return the result, never raise."""
    if ns is None:
        full = list(cmd)
    elif cmd[0] == "ip":
        full = ["ip", "-n", ns, *cmd[1:]]
    else:
        full = ["ip", "netns", "exec", ns, *cmd]
    return subprocess.run(full, capture_output=True, text=True)


def _must(*cmd: str, ns: str | None = None) -> None:
    r = _sh(*cmd, ns=ns)
    if r.returncode != 0:
        where = f" in namespace {ns}" if ns else ""
        raise UserError(f"setting up the namespaced cluster failed at '{' '.join(cmd)}'{where}: "
                        f"{r.stderr.strip() or r.stdout.strip()}; check that this machine allows "
                        "network namespaces (root, CAP_NET_ADMIN).")


# ---------------------------------------------------------------------------------------------
# 3.-5. Build


def _shape(dev: str, ns: str, gbit: float, delay_ms: float, warn: list[bool]) -> None:
    """Token bucket at `gbit` on the egress of `dev`, plus a netem delay child when asked."""
    rate_bytes = gbit * 1e9 / 8
    # Bucket: >= 4 ms of traffic (so a coarse kernel timer cannot starve the link) and >= one
    # 64 KiB GSO segment. Queue: 20 ms of traffic, at least 256 KiB: veth hands tbf 64 KiB
    # GSO packets, and a queue of only a few of them (e.g. 64 KiB) makes TCP collapse to a
    # few Mbit/s in retransmission timeouts (measured at 0.2 Gbit/s).
    burst = int(max(rate_bytes * 0.004, 65536 + 1514))
    limit = int(max(rate_bytes * 0.02, 262144))
    _must("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
          "rate", f"{gbit * 1000:.3f}mbit", "burst", str(burst), "limit", str(limit), ns=ns)
    if delay_ms > 0:
        r = _sh("tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                "delay", f"{delay_ms * 1000:.0f}us", "limit", "100000", ns=ns)
        if r.returncode != 0:
            if "unknown" not in (r.stderr + r.stdout).lower():
                raise UserError(f"adding a netem delay on {dev} in {ns} failed: {r.stderr.strip()}.")
            if not warn[0]:
                warn[0] = True
                print("[cluster] this kernel has no netem qdisc (sch_netem): links are rate-limited "
                      "but get no added latency; pass --inter-node-latency-ms 0 to silence this.",
                      file=sys.stderr, flush=True)


def build(cluster: Cluster, spec: ClusterSpec) -> None:
    """Steps 3-5: switch, nodes, links, addresses, shaping. Raises UserError on failure."""
    sw = cluster.switch
    # 3. Switch.
    _must("ip", "netns", "add", sw)
    _must("ip", "link", "set", "lo", "up", ns=sw)
    _must("ip", "link", "add", "br0", "type", "bridge", ns=sw)
    _must("ip", "link", "set", "br0", "up", ns=sw)
    warn = [spec.latency_ms <= 0]
    for i, host in enumerate(cluster.hosts):
        # 4. Node: namespace, loopback, link created inside the switch namespace and moved.
        _must("ip", "netns", "add", host)
        _must("ip", "link", "set", "lo", "up", ns=host)
        port = f"p{i}"
        _must("ip", "link", "add", port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", host, ns=sw)
        _must("ip", "link", "set", port, "master", "br0", ns=sw)
        _must("ip", "link", "set", port, "up", ns=sw)
        _must("ip", "addr", "add", f"{cluster.address(i)}/24", "dev", NODE_IFNAME, ns=host)
        _must("ip", "link", "set", NODE_IFNAME, "up", ns=host)
        # 5. Shape both directions; each hop adds half the one-way latency.
        _shape(NODE_IFNAME, host, spec.gbit, spec.latency_ms / 2, warn)
        _shape(port, sw, spec.gbit, spec.latency_ms / 2, warn)


# ---------------------------------------------------------------------------------------------
# 6.-7. Launch and wait


def agent_command(cluster: Cluster, spec: ClusterSpec, node: int) -> list[str]:
    """The torchrun agent of one node, to be run inside its namespace."""
    cmd = ["ip", "netns", "exec", cluster.hosts[node], sys.executable, "-m", "largebatch.launch",   # torchrun
           "--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.procs_per_node),
           "--node-rank", str(node), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"{cluster.address(0)}:{spec.port}", "--rdzv-id", cluster.run_id,
           # node 0 hosts the rendezvous store: torchrun's own guess compares the hostname,
           # which all namespaces share, so say it explicitly.
           "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
           "--local-addr", cluster.address(node)]
    if spec.exec_mode:
        program = list(spec.command)
        if program[0] in ("python", "python3"):
            program[0] = sys.executable
        return cmd + ["--no-python", *program]
    return cmd + ["-m", "largebatch", *spec.command]


def agent_env() -> dict[str, str]:
    """Workers bind gloo/NCCL sockets to eth0: peers on other nodes go over the shaped link,
    peers on the same node reach that local address over the namespace's loopback."""
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME=NODE_IFNAME, NCCL_SOCKET_IFNAME=NODE_IFNAME, PYTHONUNBUFFERED="1")
    return env


def _stream(node: int, pipe, lock: threading.Lock) -> None:
    """Copy one agent's output with a "[node i]" prefix; keep draining if our stdout closes,
    so that the agent never blocks on a full pipe."""
    writable = True
    for line in iter(pipe.readline, b""):
        if not writable:
            continue
        text = line.decode("utf-8", "replace").rstrip("\n")
        with lock:
            try:
                sys.stdout.write(f"[node {node}] {text}\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):  # e.g. `emulate hosts ... | head`
                writable = False
    pipe.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every agent's process group, then SIGKILL what is left after a grace period."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:  # the group may outlive its leader (workers); kill it whole
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.poll() is None:
            p.wait()


def launch_and_wait(cluster: Cluster, spec: ClusterSpec, procs: list[subprocess.Popen]) -> int:
    """Steps 6-7. `procs` is filled as agents start so that tear-down can always find them."""
    lock = threading.Lock()
    threads = []
    env = agent_env()
    for node in range(spec.nodes):
        p = subprocess.Popen(agent_command(cluster, spec, node), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
        procs.append(p)
        t = threading.Thread(target=_stream, args=(node, p.stdout, lock), daemon=True)
        t.start()
        threads.append(t)
    code = wait_for_agents(procs, spec.keep_going)
    for t in threads:
        t.join(timeout=5)
    return code


def wait_for_agents(procs: list[subprocess.Popen], keep_going: bool,
                    store_lost_grace_s: float = STORE_LOST_GRACE_S) -> int:
    """Step 7: wait for every agent (`procs[i]` is node i's); the first failure's exit code, or 0."""
    first_failure = 0
    lost_since = None   # when the first node ended for having lost node 0's store (launch.EXIT_STORE_LOST)
    running = set(range(len(procs)))
    while running:
        for node in sorted(running):
            rc = procs[node].poll()
            if rc is None:
                continue
            running.discard(node)
            if rc == EXIT_STORE_LOST and first_failure == 0:   # a consequence: node 0's own code says why
                lost_since = lost_since or time.monotonic()
            elif rc != 0 and first_failure == 0:
                first_failure = rc if rc > 0 else 128 - rc  # killed by a signal: shell convention
                print(f"[cluster] node {node} exited with code {rc}" +
                      ("" if keep_going else "; stopping the other nodes"), file=sys.stderr, flush=True)
                if not keep_going:
                    _stop(procs)
        if lost_since and first_failure == 0 and running and not keep_going \
                and time.monotonic() - lost_since > store_lost_grace_s:   # node 0 runs on: the network failed
            first_failure = EXIT_STORE_LOST
            print(f"[cluster] a node lost node 0's rendezvous store and node 0 has not ended in "
                  f"{store_lost_grace_s:g} s; stopping the other nodes", file=sys.stderr, flush=True)
            _stop(procs)
        time.sleep(0.1)
    if first_failure == 0 and lost_since:
        first_failure = EXIT_STORE_LOST
    return first_failure


# ---------------------------------------------------------------------------------------------
# 8. Tear down


def teardown(cluster: Cluster, procs: list[subprocess.Popen]) -> None:
    """Stop the agents, kill anything left inside the run's namespaces, delete the namespaces."""
    _stop(procs)
    existing = set(_sh("ip", "netns", "list").stdout.split())
    for ns in cluster.namespaces:
        if ns not in existing:
            continue
        # Everything inside these namespaces was started by this run (the agents' workers).
        for pid in _sh("ip", "netns", "pids", ns).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in reversed(cluster.namespaces):  # nodes first, the switch last
        if ns in existing:
            r = _sh("ip", "netns", "del", ns)
            if r.returncode != 0:
                print(f"[cluster] could not delete namespace {ns}: {r.stderr.strip()}; "
                      f"remove it with 'ip netns del {ns}'.", file=sys.stderr, flush=True)


class _Signalled(BaseException):
    """Raised in the main thread by SIGTERM/SIGHUP so that `finally` tears down."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run_cluster(spec: ClusterSpec) -> int:
    """Steps 2-8: build the hosts, run one agent per host, always tear down."""
    check_system()
    cluster = Cluster(run_id=secrets.token_hex(3), nodes=spec.nodes)
    procs: list[subprocess.Popen] = []

    def on_signal(signum, frame):  # noqa: ARG001 - signal API
        raise _Signalled(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        build(cluster, spec)
        hosts = ", ".join(f"{h} ({cluster.address(i)})" for i, h in enumerate(cluster.hosts))
        print(f"[cluster] hosts: {hosts}; switch {cluster.switch}; {spec.gbit:g} Gbit/s, "
              f"{spec.latency_ms:g} ms between hosts; {spec.procs_per_node} process(es) per host",
              file=sys.stderr, flush=True)
        return launch_and_wait(cluster, spec, procs)
    except KeyboardInterrupt:
        print("[cluster] interrupted; tearing down", file=sys.stderr, flush=True)
        return 130
    except _Signalled as sig:
        print(f"[cluster] got signal {sig.signum}; tearing down", file=sys.stderr, flush=True)
        return 128 + sig.signum
    finally:
        # A second Ctrl-C during tear-down would leave namespaces behind: ignore it meanwhile.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        try:
            teardown(cluster, procs)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for s, h in previous.items():
                signal.signal(s, h)


def main(argv: list[str]) -> int:
    """`largebatch emulate hosts [options] -- COMMAND ...`"""
    return run_cluster(parse_args(argv))
