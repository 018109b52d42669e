"""`largebatch emulate hosts`: namespaces are made and always removed, the hosts talk over
torch.distributed, the inter-node link is shaped while intra-node traffic is not, and
training runs across two namespaced hosts.

Every run is a real `largebatch emulate hosts` subprocess (root, iproute2, real
namespaces, real torchrun agents). The tests skip only when this machine cannot
create network namespaces.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from largebatch.errors import UserError

REPO = Path(__file__).resolve().parents[2]
HOSTS_LINE = re.compile(r"\[cluster\] hosts: .*?switch (lbc-([0-9a-f]{6})-sw)")


def _can_make_namespaces() -> str | None:
    """None when namespaces can be made here, else why not."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    name = f"lbc-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


WHY_NOT = _can_make_namespaces()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"cluster tests need namespaces: {WHY_NOT}")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "largebatch", "emulate", "hosts", *args]


def _run(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO)


def _run_id(stderr: str) -> str:
    m = HOSTS_LINE.search(stderr)
    assert m, f"no '[cluster] hosts:' line in:\n{stderr}"
    return m.group(2)


def _namespaces_of(run_id: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"lbc-{run_id}-")]


def _results(stdout: str) -> list[dict]:
    return [json.loads(m.group(1)) for m in re.finditer(r"^\[node \d+\] RESULT (.*)$", stdout, re.M)]


# A worker program, run on every rank through `emulate hosts --exec`.
CHECK = textwrap.dedent("""
    import json, os, socket, sys, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("10.213.0.1", 9))  # no packet is sent: this only picks the source address
    addr = s.getsockname()[0]
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    out = {"rank": rank, "group_rank": int(os.environ["GROUP_RANK"]),
           "local_rank": int(os.environ["LOCAL_RANK"]), "addr": addr,
           "sum_ok": bool(torch.all(t == world * (world + 1) / 2))}
    if sys.argv[1] == "shaping":
        # rank 0 sends 12.5 MB to a peer and waits for a 1-element reply; the peer is
        # rank 1 (same host) and then rank local_world (the next host).
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        big, ack = torch.zeros(12_500_000 // 4), torch.zeros(1)
        for name, peer in (("intra", 1), ("inter", local)):
            best = float("inf")
            for _ in range(3):
                dist.barrier()
                if rank == 0:
                    t0 = time.perf_counter()
                    dist.send(big, peer)
                    dist.recv(ack, peer)
                    best = min(best, time.perf_counter() - t0)
                elif rank == peer:
                    dist.recv(big, 0)
                    dist.send(ack, 0)
            if rank == 0:
                out[name + "_gbit"] = big.numel() * 4 * 8 / best / 1e9
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)   # as largebatch.dist.end_process: no interpreter finalization while gloo threads live
""")


@pytest.fixture
def check_script(tmp_path: Path) -> Path:
    path = tmp_path / "cluster_check.py"
    path.write_text(CHECK)
    return path


# ---------------------------------------------------------------------------------------------
# Arguments and environment (no namespaces needed)


@pytest.mark.parametrize("args, words", [
    (["--nodes", "0", "--", "bench", "allreduce"], "--nodes"),
    (["--procs-per-node", "0", "--", "bench", "allreduce"], "--procs-per-node"),
    (["--inter-node-gbit", "0", "--", "bench", "allreduce"], "--inter-node-gbit"),
    (["--inter-node-latency-ms", "-1", "--", "bench", "allreduce"], "--inter-node-latency-ms"),
    (["--nodes", "2"], "no command"),
    (["--bogus", "--", "bench"], "unrecognized"),
])
def test_bad_arguments_are_user_errors(args: list[str], words: str) -> None:
    from largebatch.commands.emulate_hosts import parse_args

    with pytest.raises(UserError, match=re.escape(words)):
        parse_args(args)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop it")
def test_without_root_exits_2_with_one_sentence() -> None:
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    readable = subprocess.run([*nobody, sys.executable, "-c", "import largebatch"], capture_output=True, timeout=60, cwd="/")
    if readable.returncode != 0:   # e.g. a checkout under a 0700 directory (mktemp -d): the user cannot run it
        pytest.skip(f"uid 65534 cannot import largebatch from this checkout ({REPO}); put it where others can read it")
    r = subprocess.run([*nobody, *_cli("--", "bench", "allreduce")], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 2, r.stderr
    assert "needs root" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------
# (a) set-up and tear-down


@needs_netns
@pytest.mark.timeout(180)
def test_failing_command_exits_nonzero_and_leaves_nothing() -> None:
    r = _run("--nodes", "2", "--exec", "--", "python", "-c", "import sys; sys.exit(3)")
    assert r.returncode != 0, r.stdout + r.stderr
    run_id = _run_id(r.stderr)
    assert _namespaces_of(run_id) == []


@needs_netns
@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_down_namespaces_and_agents(signum: int) -> None:
    # SIGINT as at a terminal: a suite started in the background (nohup, &) hands its children an
    # ignored SIGINT, which Python then keeps ignoring
    proc = subprocess.Popen(_cli("--nodes", "2", "--exec", "--", "python", "-c", "import time; time.sleep(120)"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        run_id = None
        for line in proc.stderr:  # the hosts line comes once the namespaces exist
            m = HOSTS_LINE.search(line)
            if m:
                run_id = m.group(2)
                break
        assert run_id, "emulate hosts ended before it reported its hosts"
        assert len(_namespaces_of(run_id)) == 3  # switch + 2 hosts
        time.sleep(2)  # let the agents start their workers
        pids = subprocess.run(["ip", "netns", "pids", f"lbc-{run_id}-n0"], capture_output=True, text=True).stdout.split()
        proc.send_signal(signum)
        rc = proc.wait(timeout=60)
        assert rc == 128 + signum or (signum == signal.SIGINT and rc == 130), rc
        assert _namespaces_of(run_id) == []
        for pid in pids:  # the agents and their workers are gone too
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# (b) all-reduce across two namespaced hosts


@needs_netns
@pytest.mark.timeout(180)
def test_allreduce_across_two_hosts(check_script: Path) -> None:
    r = _run("--nodes", "2", "--procs-per-node", "1", "--exec", "--", "python", str(check_script), "check")
    assert r.returncode == 0, r.stdout + r.stderr
    results = _results(r.stdout)
    assert sorted(x["rank"] for x in results) == [0, 1]
    assert all(x["sum_ok"] for x in results)
    assert sorted(x["group_rank"] for x in results) == [0, 1]
    assert len({x["addr"] for x in results}) == 2  # two hosts, two addresses
    assert _namespaces_of(_run_id(r.stderr)) == []


# ---------------------------------------------------------------------------------------------
# (c) the inter-node link is shaped; intra-node traffic is not


@needs_netns
@pytest.mark.timeout(240)
def test_inter_node_rate_is_shaped_and_intra_node_is_not(check_script: Path) -> None:
    gbit = 0.2
    r = _run("--nodes", "2", "--procs-per-node", "2", "--inter-node-gbit", str(gbit),
             "--inter-node-latency-ms", "0", "--exec", "--", "python", str(check_script), "shaping")
    assert r.returncode == 0, r.stdout + r.stderr
    results = {x["rank"]: x for x in _results(r.stdout)}
    assert sorted(results) == [0, 1, 2, 3] and all(x["sum_ok"] for x in results.values())
    assert results[0]["group_rank"] == results[1]["group_rank"] != results[2]["group_rank"]
    inter, intra = results[0]["inter_gbit"], results[0]["intra_gbit"]
    print(f"inter-node {inter:.3f} Gbit/s (shaped at {gbit}), intra-node {intra:.3f} Gbit/s")
    assert 0.25 * gbit < inter < 2 * gbit
    assert intra > 5 * gbit


# ---------------------------------------------------------------------------------------------
# Two training steps across two namespaced hosts


@needs_netns
@pytest.mark.timeout(420)
def test_two_training_steps_across_two_hosts(tmp_path: Path) -> None:
    """2 hosts x 2 processes, the gradients averaged by the native-composed hierarchical hook (the backend's
    reduce-scatter in a node, all-reduce across, all-gather in a node; no communication thread)."""
    r = _run("--nodes", "2", "--procs-per-node", "2", "--", "train", "fashion_mnist",
             "--set", "train.max_steps=2", "--set", "schedule.epochs=1",
             "--set", "model.name=resnet18", "--set", "model.width=8", "--set", "batch.global_batch=64",
             "--set", "comm.algorithm=hierarchical", "--set", "comm.impl=native", "--set", "comm.inter=native",
             "--set", "comm.small_bytes=0", "--set", "train.log_every=1",
             timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    # node 1's lines are its workers' C++ warnings, which its agent's own level (ERROR, launch.main) leaves alone
    assert "[node 0]" in r.stdout and "[node 1]" in r.stdout
    runs = list(tmp_path.glob("runs/*/summary.json"))
    assert len(runs) == 1 and json.loads(runs[0].read_text())["world_size"] == 4
    assert _namespaces_of(_run_id(r.stderr)) == []


@needs_netns
@pytest.mark.timeout(180)
def test_a_user_error_on_the_hosts_exits_2_without_a_traceback() -> None:
    """The workers on both hosts reject the config: each node's agent (largebatch.launch) exits 2, and so
    does `emulate hosts`, with the workers' sentence and no ChildFailedError traceback."""
    proc = subprocess.run(_cli("--nodes", "2", "--", "train", "--set", "optim.lr=-1", "--quiet"),
                          capture_output=True, text=True, cwd=REPO, timeout=170)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "optim.lr is -1.0" in out
    assert "Traceback" not in out and "ChildFailedError" not in out


# Node 0's worker fails at once; every other node's worker would run on for a minute.
NODE0_FAILS = textwrap.dedent("""
    import os, sys, time
    if os.environ["GROUP_RANK"] == "0":
        print("node 0's worker exits 2", flush=True)
        sys.exit(2)
    time.sleep(60)
""")


@needs_netns
@pytest.mark.timeout(180)
def test_the_other_nodes_end_in_one_line_when_node_0_and_its_store_are_gone(tmp_path: Path) -> None:
    """torch's agent ends without waiting for the others when its workers fail, and node 0's agent hosts
    the rendezvous store: node 1's agent meets the closed store at its next check. With --keep-going
    nothing stops node 1 first, so this is the case every time (without it, only when node 1's check
    comes before `emulate hosts` stops it: the flake of the test above). Node 1 ends early, in one line, with
    its worker stopped; no Python traceback, no C++ stack frames."""
    script = tmp_path / "node0_fails.py"
    script.write_text(NODE0_FAILS)
    t0 = time.monotonic()
    r = _run("--nodes", "2", "--keep-going", "--exec", "--", "python", str(script), timeout=170)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out   # node 0's own code: node 1's (launch.EXIT_STORE_LOST) only follows from it
    assert "[cluster] node 0 exited with code 2" in r.stderr, out
    assert "node 0's worker exits 2" in out
    assert re.search(r"^\[node 1\] largebatch: node 1 lost the rendezvous store at 10\.213\.0\.1:\d+: .*"
                     r"node 1's workers were stopped\.$", r.stdout, re.M), out
    assert "Traceback" not in out and "frame #" not in out and "TCPStore.cpp" not in out, out
    assert time.monotonic() - t0 < 55, "node 1 slept on instead of ending with the store"
    assert _namespaces_of(_run_id(r.stderr)) == []


def _agent(code: int, after_s: float) -> subprocess.Popen:
    """A stand-in agent process (its own process group, as `emulate hosts` starts them): exits `code` after `after_s`."""
    return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({after_s}); sys.exit({code})"],
                            start_new_session=True)


def test_a_node_that_lost_the_store_first_does_not_hide_node_0s_code(capfd: pytest.CaptureFixture[str]) -> None:
    """Node 1's agent exits EXIT_STORE_LOST while node 0's process still tears down: `emulate hosts` reports
    node 0's own code, which says why, not node 1's consequence (the race that made the test above flaky)."""
    from largebatch.commands.emulate_hosts import wait_for_agents
    from largebatch.launch import EXIT_STORE_LOST

    for keep_going in (False, True):
        procs = [_agent(2, 1.5), _agent(EXIT_STORE_LOST, 0.0)]
        assert wait_for_agents(procs, keep_going) == 2
        assert "[cluster] node 0 exited with code 2" in capfd.readouterr().err


def test_a_node_that_lost_the_store_while_node_0_runs_on_stops_the_run(capfd: pytest.CaptureFixture[str]) -> None:
    """The network to node 0 failed: node 0 does not end, so after the grace period the others are stopped and
    the code is EXIT_STORE_LOST."""
    from largebatch.commands.emulate_hosts import wait_for_agents
    from largebatch.launch import EXIT_STORE_LOST

    procs = [_agent(0, 120.0), _agent(EXIT_STORE_LOST, 0.0)]
    t0 = time.monotonic()
    try:
        assert wait_for_agents(procs, keep_going=False, store_lost_grace_s=0.5) == EXIT_STORE_LOST
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert time.monotonic() - t0 < 30
    assert procs[0].returncode == -signal.SIGTERM
    assert "node 0 has not ended in 0.5 s; stopping the other nodes" in capfd.readouterr().err
