"""The daemon's pure logic: the token file's checks, a pid reused by a new process, the
histograms' buckets, an empty batch, the features each engine's plugin declares."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from profinfer.daemon.governor import Governor
from profinfer.daemon.discovery.identity import Identity, container_of, pod_uid_of
from profinfer.daemon.plugins import capabilities
from profinfer.daemon.watch import Watch
from profinfer.core.plugin.processmetrics import Histogram
from profinfer.daemon.export.metrics import Metrics
from profinfer.daemon.http.server import parse_listen
from profinfer.daemon.http.tokens import load_token
from profinfer.core.base.errors import ProfinferError
from profinfer.core.profile.model import TokenCall
from profinfer.core.plugin.packs import load_pack
from profinfer.core.profile.stats import SequenceTracker


def test_token_file_made_private_and_checked(tmp_path):
    path = tmp_path / "token"
    token = load_token(None, str(path))
    assert (path.stat().st_mode & 0o777) == 0o600 and len(token) >= 32
    assert load_token(None, str(path)) == token            # read back, the same
    os.chmod(path, 0o644)
    with pytest.raises(ProfinferError, match="readable by others"):
        load_token(None, str(path))
    link = tmp_path / "link"
    os.chmod(path, 0o600)
    link.symlink_to(path)
    with pytest.raises(ProfinferError):                    # a link is not followed
        load_token(None, str(link))


def test_an_empty_token_file_of_ours_is_replaced(tmp_path):
    """What a crash while writing it left: made anew, said once; an empty file readable by
    others is still refused."""
    empty = tmp_path / "empty"
    os.close(os.open(empty, os.O_WRONLY | os.O_CREAT, 0o600))
    said = []
    token = load_token(None, str(empty), warn=said.append)
    assert len(token) >= 32 and empty.read_text() == token + "\n" and (empty.stat().st_mode & 0o777) == 0o600
    assert len(said) == 1 and "empty" in said[0]
    assert load_token(None, str(empty), warn=said.append) == token and len(said) == 1
    shared = tmp_path / "shared"
    os.close(os.open(shared, os.O_WRONLY | os.O_CREAT, 0o644))
    os.chmod(shared, 0o644)
    with pytest.raises(ProfinferError, match="readable by others"):
        load_token(None, str(shared))


def test_a_crash_while_writing_the_token_leaves_no_file(tmp_path):
    """The first start killed at its write (SIGXFSZ: a file size limit of 0): no token file
    is left, so the next start makes one."""
    path = tmp_path / "token"
    code = ("import resource, signal\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
            "from profinfer.daemon.http.tokens import load_token\n"
            f"load_token(None, {str(path)!r})\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGXFSZ, done.stderr
    assert not path.exists() and os.listdir(tmp_path) == []
    token = load_token(None, str(path))
    assert path.read_text() == token + "\n"


def test_listen_addresses():
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", "host:", "h:99999", "h:x"):
        with pytest.raises(ProfinferError):
            parse_listen(bad)


def _ident(pid: int, start: int) -> Identity:
    return Identity(pid, start, "llama-server", "/bin/llama-server", "llama.cpp")


def test_a_reused_pid_is_a_new_process():
    m = Metrics()
    old, new = _ident(42, 1000), _ident(42, 2000)
    m.watched(old)
    call = TokenCall(42, 0, 10, 1, False)
    m.decode_call(old, call, [], [])
    m.watched(new)                         # the same pid, a new process: its series replace
    m.decode_call(old, call, [], [])       # a late event of the old one is not the new one's
    m.decode_call(new, call, [], [])
    assert m.processes[42].identity == new and m.processes[42].calls == {"decode": 1}
    m.forget(old)                          # the old one's TTL ends: the new one stays
    assert 42 in m.processes
    m.forget(new)
    assert 42 not in m.processes


TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_features_are_the_plugins_declared_ones(tmp_path):
    """Each engine's features as its plugin declares them; a --pack that names another
    plugin's collector (the ops pack names vLLM's) gets that plugin's; one whose collector
    no plugin holds gets none."""
    assert capabilities(load_pack("llamacpp")) == {"tokens_by_process", "graph_totals", "op_totals",
                                                  "records_by_process"}
    assert capabilities(load_pack("vllm")) == {"steps_by_process", "op_totals", "ops_on_callers"}
    assert capabilities(load_pack("cuda")) == frozenset()
    assert capabilities(load_pack(os.path.join(TESTS, "levels", "cuda", "ops_pack.toml"))) == {"steps_by_process", "op_totals", "ops_on_callers"}
    alien = tmp_path / "alien.toml"
    alien.write_text(open(os.path.join(TESTS, "levels", "cuda", "ops_pack.toml")).read().replace(
        "profinfer.engines.vllm.collector", "profinfer.engines.vllmx.collector"))
    assert capabilities(load_pack(str(alien))) == frozenset()


def test_no_op_level_is_given_back_to_an_engine_without_one():
    """The governor steps the op level up only for an engine whose plugin declares op
    totals: a process of one that does not, with room, is left at its step level."""
    asked = []
    gov = Governor(0.04, Metrics(), lambda w, levels, why: asked.append((w, levels)) or True)
    try:
        for caps, levels in ((frozenset({"steps_by_process"}), {"step"}),
                             (frozenset({"tokens_by_process", "op_totals"}), {"token"})):
            w = Watch(_ident(42, 1000), None, set(levels), 0.0, capabilities=caps, share=0.001,
                      calm_since=0.0)
            gov._judge(w, 100.0, {"token", "graph", "op"}, w.share)
        assert [sorted(levels) for _, levels in asked] == [["op", "token"]]
    finally:
        gov.close()


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((0.001, 0.01, 0.1))
    for v in (0.001, 0.005, 0.01, 0.5):
        h.observe(v)
    assert h.buckets() == [("0.001", 1), ("0.01", 3), ("0.1", 3), ("+Inf", 4)]
    assert h.total == pytest.approx(0.516)


def test_an_empty_batch_counts_nothing():
    t = SequenceTracker(keep=False)
    assert t.feed(TokenCall.of_batch(1, 0, 10, 0, -1)) == ([], [])


def test_container_and_pod_from_cgroup_paths():
    cid = "ab" * 32
    assert container_of(f"/system.slice/docker-{cid}.scope") == cid[:12]
    assert container_of(f"/docker/{cid}") == cid[:12]
    assert container_of(f"/kubepods/besteffort/pod1/{cid}") == cid[:12]
    assert container_of("/user.slice/session-1.scope") == ""
    assert pod_uid_of("/kubepods.slice/kubepods-burstable.slice/"
                      "kubepods-burstable-pod7a1f3c2e_5b6d_4e8f_9a0b_1c2d3e4f5a6b.slice/x") == \
        "7a1f3c2e-5b6d-4e8f-9a0b-1c2d3e4f5a6b"


def test_a_capture_slot_is_held_until_its_trace_is_sent(monkeypatch):
    """The daemon's HTTP endpoint with a capture whose trace (16 MiB, more than the kernel's
    socket buffers hold) a client does not read: the server's write blocks, and the slot is
    still taken (a second capture of the process: 409) until the client reads it all. The
    capture's output alone is stood in for: what is tested is when the slot is freed."""
    import socket
    import threading
    import time
    import urllib.error
    import urllib.request

    from profinfer.daemon.http import server as server_module
    from profinfer.daemon.flight.captures import Captures

    trace = os.urandom(16 << 20)
    monkeypatch.setattr(Captures, "_capture", lambda self, pid, seconds, levels: (trace, {}))

    from prometheus_client import CollectorRegistry

    class Metrics:
        registry = CollectorRegistry()

        def http_dropped(self, reason):
            pass

    class Watching:
        lock = threading.Lock()
        watches = {os.getpid(): None}
        metrics = Metrics()

    srv = server_module.make_server(Watching(), "127.0.0.1", 0, "t" * 32, lambda msg: None)
    srv.start()
    port = srv.port
    query = f"/capture?pid={os.getpid()}&seconds=1&levels=token"

    def post() -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{query}", method="POST",
                                     headers={"Authorization": "Bearer " + "t" * 32})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", port))
        slow.sendall(f"POST {query} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {'t' * 32}\r\n"
                     "Content-Length: 0\r\n\r\n".encode())
        slow.settimeout(30)
        assert slow.recv(1, socket.MSG_PEEK) == b"H"      # the response has begun
        time.sleep(0.5)
        assert post() == 409
        got = 0
        while chunk := slow.recv(1 << 20):
            got += len(chunk)
        slow.close()
        assert got > len(trace)
        assert post() == 200                               # freed once sent
    finally:
        srv.close()


def test_trap_costs_none_say_why(monkeypatch):
    """No calibration cached and no compiler to build the measurement: no trap costs (the
    kernel-counted BPF time alone), and the reason, for /status."""
    from profinfer.core.calibration import nativebuild, probecost
    from profinfer.core.base.errors import ProfinferError
    from profinfer.daemon import governor

    def no_compiler(*_):
        raise ProfinferError("calibrate needs a C compiler: apt-get install gcc")

    monkeypatch.setattr(probecost, "cached", lambda: None)
    monkeypatch.setattr(nativebuild, "build", no_compiler)
    costs, how = governor.trap_costs()
    assert costs == dict.fromkeys(governor.TRAP_KEYS, 0.0)
    assert how.startswith("none: ") and "C compiler" in how, how


def test_a_shared_objects_cost_is_charged_by_each_processs_hits():
    """Charges: what a shared object cost between two charges goes to its processes by the
    probe hits each made meanwhile, by level."""
    from profinfer.daemon.shared import Charges
    c = Charges()
    c.charge(1000.0, {1: {"token": 0, "graph": 0}, 2: {"token": 0, "graph": 0}})
    c.charge(5000.0, {1: {"token": 30, "graph": 10}, 2: {"token": 0, "graph": 0}})
    c.charge(7000.0, {1: {"token": 30, "graph": 10}, 2: {"token": 10, "graph": 10}})
    assert c.of(1) == {"token": 3000.0, "graph": 1000.0}
    assert c.of(2) == {"token": 1000.0, "graph": 1000.0}


def test_a_capture_is_priced_at_what_its_levels_cost_the_process():
    """A capture at the op level of a process at 1.5% whose op level cost 3% when it had it:
    4.5%, over a 4% budget; at the token level it fits (1.5% + its token share 0.5%)."""
    gov = Governor(0.04, Metrics(), lambda w, levels, why: True)
    try:
        w = Watch(_ident(42, 1000), None, {"token"}, 0.0, share=0.015,
                  known_shares={"op": 0.03, "token": 0.005, "daemon": 0.01})
        fits, why = gov.capture_fits(w, {"op"})
        assert not fits and "PID 42 costs 1.50% now" in why and "op 3.00%" in why and "4.50% > budget 4.00%" in why
        assert gov.capture_fits(w, {"token"})[0]
        w.share = None        # just stepped: its levels' last known costs stand in
        assert "costs 1.50% now" in gov.capture_fits(w, {"op"})[1]
    finally:
        gov.close()


def test_a_running_captures_price_counts_against_the_budget():
    """A process at 3.05% with its graph level, under a 4% budget: with nothing else it keeps
    its levels; with a capture priced 1.17% running (4.22%), its graph level steps down and
    the log says both; idle, the capture costs it nothing; and no level comes back while the
    capture runs, however much room."""
    asked = []
    gov = Governor(0.04, Metrics(), lambda w, levels, why: asked.append((sorted(levels), why)) or True)
    try:
        w = Watch(_ident(42, 1000), None, {"token", "graph"}, 0.0, share=0.0305)
        gov._judge(w, 100.0, {"token", "graph"}, w.share)
        assert asked == []
        gov.capture_cost = lambda pid: 0.0117 if pid == 42 else None
        gov._judge(w, 102.0, {"token", "graph"}, w.share)
        assert asked == [(["token"], "costs 3.0% and its capture 1.2% > budget 4.0%")], asked
        asked.clear()
        w.idle = True
        gov._judge(w, 104.0, {"token", "graph"}, 0.0)
        w.idle, w.levels, w.calm_since = False, {"token"}, 0.0
        gov._judge(w, 200.0, {"token", "graph"}, 0.001)
        assert asked == [] and w.calm_since is None, asked
    finally:
        gov.close()


SWITCHER = """
import resource, sys, threading, time
arrived, done = threading.Barrier(4), threading.Event()
def sleeper():
    for _ in range(100):
        time.sleep(0.001)
    arrived.wait()
    done.wait()          # alive while counted: an ended thread leaves /proc/PID/task
threads = [threading.Thread(target=sleeper) for _ in range(3)]
for t in threads:
    t.start()
arrived.wait()
r = resource.getrusage(resource.RUSAGE_SELF)
print(r.ru_nvcsw, r.ru_nivcsw, flush=True)
sys.stdin.read()
done.set()
"""


def test_context_switches_are_the_kernels_count_for_every_thread():
    """The sched level's price counts every thread's switches: a process whose three threads
    slept 100 times each, then wait: what the governor reads of its threads equals the
    kernel's own count for the whole process (getrusage, another interface), within the
    few switches its threads make between the two readings (a wait begun, the print, the
    read of stdin)."""
    from profinfer.daemon.governor import context_switches
    child = subprocess.Popen([sys.executable, "-c", SWITCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        voluntary, other = map(int, child.stdout.readline().split())
        ours = context_switches(child.pid)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert ours is not None and len(ours) == 4, ours            # the main thread and its three
    ours_voluntary, ours_other = sum(v for v, _ in ours.values()), sum(o for _, o in ours.values())
    assert ours_voluntary >= 300, (ours, voluntary)
    assert voluntary <= ours_voluntary <= voluntary + 8 and other <= ours_other <= other + 8, (ours, voluntary, other)


def test_an_unattended_capture_prices_what_it_can_and_names_what_it_cannot():
    """A level never measured on the process (op) cannot be priced: named, with why; the
    sched level is priced from its threads' switches (a thread busy and one sleeping ~1,000
    times a second: above 0, and below 3,000 voluntary switches a second, three events each,
    against a tenth of a CPU)."""
    from profinfer.daemon.governor import SCHED_EVENT_NS
    gov = Governor(0.04, Metrics(), lambda w, levels, why: True)
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(lambda: stop.is_set(), True)])
    sleeper = threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(lambda: stop.is_set(), True)])
    try:
        w = Watch(_ident(os.getpid(), 1000), None, {"token"}, 0.0, share=0.01, known_shares={"token": 0.005})
        busy.start()
        sleeper.start()
        priced, unpriced = gov.capture_prices(w, {"op", "sched", "token"})
        assert set(unpriced) == {"op"} and "never measured here" in unpriced["op"], unpriced
        assert set(priced) == {"sched"} and 0 < priced["sched"] < 3000 * 3 * SCHED_EVENT_NS / 0.1e9, priced
        why = gov.capture_fits(w, {"sched", "token"}, priced)[1]
        assert f"sched {priced['sched']:.2%}" in why and "sched estimated" in why, why
        assert "op never measured on it, not counted" in gov.capture_fits(w, {"op"})[1]
    finally:
        stop.set()
        busy.join()
        sleeper.join()
        gov.close()


def test_graph_counts_carry_over_a_move_between_shared_objects():
    """The governor moves a process to another shared object (the graph level taken and
    given back): that object's counts begin at 0, and are added to what was counted before,
    so the exported counter never goes down."""
    m = Metrics()
    ident = _ident(42, 1000)
    m.watched(ident)
    m.graphs(ident, {"CPU": (10, 1000, 50, [1, 2])})
    m.carry_graphs(ident)
    m.graphs(ident, {"CPU": (3, 300, 15, [0, 1, 4])})
    assert m.processes[42].graphs == {"CPU": (13, 1300, 65, [1, 3, 4])}
    m.graphs(ident, {"CPU": (5, 500, 25, [0, 2, 4])})
    assert m.processes[42].graphs["CPU"][0] == 15
