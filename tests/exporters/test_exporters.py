"""Exporters on synthetic profiles: JSON summary, Perfetto trace (round trip, structure, damage),
Chrome JSON."""
from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import BuiltinClock, Trace, TracePacket, TrackEvent
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from profinfer.exporters.json_summary import summary, write_json
from profinfer.exporters.perfetto import write_chrome_json, write_perfetto
from profinfer.exporters.trace_reader import TraceFormatError, read_trace
from profinfer.core.profile.model import GraphCall, OpSlice, Profile, TokenCall

OPS = ["MUL_MAT", "RMS_NORM+MUL", "ADD", "ROPE", "SOFT_MAX", "GET_ROWS"]


def synth(n_tokens=6, n_threads=3, n_nodes=12, seed=0, prompt=2, messy=False, counters=False) -> Profile:
    """A llama.cpp-like run: per token a llama_decode call on the main thread, one graph inside
    it, and per node one op per thread ending in a shared barrier. `messy` adds the data defects
    the exporter must survive: overlapping ops, ops past their graph, zero-length ops and waits."""
    rnd = random.Random(seed)
    main = 1000
    p = Profile(pid=main, process_name="llama-cli",
                thread_names={main: "llama-cli", **{main + i: f"w{i}" for i in range(1, n_threads)},
                              4242: "idle-thread"},
                lost_events=3, meta={"engine": "llama.cpp", "model": "/m/ünï.gguf", "build_id.libggml": "ab12"})
    t = 5_000_000_000
    for k in range(n_tokens):
        prefill = k < prompt
        tok_start = t
        t += rnd.randint(1000, 5000)
        g_start = t
        t += 100
        for node in range(n_nodes):
            node_start, ends = t, []
            for th in range(n_threads):
                s = node_start + rnd.randint(0, 50)
                e = s + rnd.choice([0, rnd.randint(1, 3000)]) if messy else s + rnd.randint(1, 3000)
                ends.append(e)
                p.ops.append(OpSlice(tid=main + th, cpu=rnd.randint(0, 7), start_ns=s, end_ns=e, barrier_end_ns=0,
                                     op=OPS[node % len(OPS)], name=f"blk.{node}", ne=(4096, node + 1, 1, 1),
                                     dtype=rnd.choice(["f32", "f16", "q4_0"]),
                                     tensor=0x7F0000 + 64 * node if node % 3 else 0,
                                     srcs=(0x7E0000 + node, 0x7F0000 + 64 * (node - 1))[:node % 3],
                                     src_views=(0x7D0000, 0)[:node % 3],
                                     fused_tensor=0x7C0000 + node if node % 4 == 1 else 0,
                                     src_ne=((4096, 4096, 1, 1),) if node % 3 else (),
                                     src_dtypes=("f16",) if node % 3 else (),
                                     counters=(float(e - s), rnd.random() * 1e6)
                                     if counters and rnd.random() < 0.9 else None,
                                     experts=((1, 5), (7, 0)) if node % 5 == 2 else None))
            barrier_end = max(ends) + rnd.randint(0, 100)
            for o in p.ops[-n_threads:]:
                o.barrier_end_ns = o.end_ns if messy and rnd.random() < 0.2 else barrier_end
                if messy and rnd.random() < 0.1:     # next op starts before this barrier ends
                    o.barrier_end_ns = barrier_end + 500
            t = barrier_end
        t += 100
        g_end = t - (300 if messy and k % 2 else 0)   # messy: the last ops run past the graph end
        p.graphs.append(GraphCall(tid=main, start_ns=g_start, end_ns=g_end, backend="CPU", n_nodes=n_nodes,
                                  function="ggml_backend_sched_graph_compute_async" if k % 2 else ""))
        t += rnd.randint(100, 1000)
        p.tokens.append(TokenCall(tid=main, start_ns=tok_start, end_ns=t, n_tokens=7 if prefill else 1,
                                  prefill=prefill, ret=-1 if k == 3 else 0))
        t += rnd.randint(0, 10000)
    if counters:
        p.counter_names = ["task-clock", "r01a3"]
        p.counter_dropped = {"migrated": sum(o.counters is None for o in p.ops), "unreadable": 0}
    return sorted_profile(p)


def sorted_profile(p: Profile) -> Profile:
    """read_trace returns each list sorted by (start_ns, tid), stably."""
    key = lambda x: (x.start_ns, x.tid)  # noqa: E731
    p.tokens.sort(key=key)
    p.graphs.sort(key=key)
    p.ops.sort(key=key)
    return p


# --------------------------------------------------------------------------- JSON summary

def _plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    return x is None or type(x) in (bool, int, float, str)


def test_summary_keys_and_values(tmp_path):
    p = Profile(pid=7, tokens=[TokenCall(7, 0, 100, 5, True), TokenCall(7, 200, 250, 1, False)],
                graphs=[GraphCall(7, 10, 90, "CPU", 2)],
                ops=[OpSlice(7, 0, 20, 50, 60, "MUL_MAT", "a", (1, 2, 3, 4), "f16"),
                     OpSlice(8, 1, 30, 40, 60, "ADD", "b", (1, 1, 1, 1), "f32")],
                lost_events=2, thread_names={7: "main"}, meta={"engine": "llama.cpp"})
    s = summary(p)
    assert _plain(s)
    assert s["decode_calls"] == 2
    assert s["tokens"] == {"prefill": 5, "decode": 1}
    assert s["time_ns"] == {"prefill": 100, "decode": 50}
    assert s["lost_events"] == 2
    # each thread ran ops in the one graph (10..90): its whole duration is their graph time;
    # thread 8 started it 10 ns after thread 7
    assert s["threads"] == [{"tid": 7, "name": "main", "graph_ns": 80, "arrival_ns": 0, "op_ns": 30,
                             "barrier_ns": 10},
                            {"tid": 8, "name": "", "graph_ns": 80, "arrival_ns": 10, "op_ns": 10,
                             "barrier_ns": 20}]
    assert [(o["op"], o["count"], o["total_ns"]) for o in s["ops"]] == [("MUL_MAT", 1, 30), ("ADD", 1, 10)]
    assert s["ops"][0]["share"] == pytest.approx(0.75)
    assert s["ttft_ns"] == 100 and s["tpot_ns"] == 150 and s["tokens_per_s"] == pytest.approx(1 / 50e-9)
    assert s["graphs"] == 1 and s["meta"] == {"engine": "llama.cpp"}
    assert s["phases"]["prefill"]["ops"] == [{"op": "MUL_MAT", "count": 1, "total_ns": 30},
                                             {"op": "ADD", "count": 1, "total_ns": 10}]
    out = tmp_path / "s.json"
    write_json(p, out)
    assert json.loads(out.read_text()) == s


def test_summary_of_empty_profile_is_plain():
    s = summary(Profile(pid=1))
    assert _plain(s) and s["ttft_ns"] is None and s["ops"] == [] and s["tokens"] == {"prefill": 0, "decode": 0}


# --------------------------------------------------------------------------- Perfetto: round trip

@pytest.mark.parametrize("messy", [False, True])
@pytest.mark.parametrize("counters", [False, True])
def test_perfetto_round_trip_is_exact(tmp_path, messy, counters):
    p = synth(messy=messy, counters=counters)
    path = tmp_path / "run.pftrace"
    write_perfetto(p, path)
    assert read_trace(path) == p


@pytest.mark.parametrize("seed", range(8))
def test_perfetto_round_trip_random_overlaps(tmp_path, seed):
    """Arbitrary intervals on few threads: whatever overlaps, the file nests and reads back exactly."""
    rnd = random.Random(seed)
    tids = [10, 11, 12]

    def interval():
        s = rnd.randint(0, 2000)
        return s, s + rnd.choice([0, rnd.randint(0, 300)])

    tokens = [TokenCall(rnd.choice(tids), *interval(), rnd.randint(1, 9), rnd.random() < 0.5) for _ in range(15)]
    graphs = [GraphCall(rnd.choice(tids), *interval(), "CPU", rnd.randint(1, 99)) for _ in range(20)]
    ops = []
    for _ in range(300):
        s, e = interval()
        ops.append(OpSlice(rnd.choice(tids), rnd.randint(0, 3), s, e, e + rnd.choice([0, rnd.randint(0, 200)]),
                           rnd.choice(OPS), f"n{rnd.randint(0, 5)}", (rnd.randint(1, 9), 1, 1, 1), "f32"))
    ops.append(OpSlice(10, 0, 500, 400, 300, "ADD", "backwards", (1, 1, 1, 1), "f32"))   # end < start
    p = sorted_profile(Profile(pid=10, tokens=tokens, graphs=graphs, ops=ops))
    path = tmp_path / "r.pftrace"
    write_perfetto(p, path)
    check_trace_structure(path)
    assert read_trace(path) == p


def test_perfetto_empty_profile_round_trip(tmp_path):
    p = Profile(pid=5, process_name="", meta={"k": "v"}, lost_events=0)
    write_perfetto(p, tmp_path / "e.pftrace")
    assert read_trace(tmp_path / "e.pftrace") == p


# --------------------------------------------------------------------------- Perfetto: structure

def check_trace_structure(path) -> dict:
    """Interpret the file the way trace_processor does (sequence state, packet defaults, interning,
    incremental clock, slice stacks per track) and assert what it needs. Returns what it saw."""
    trace = Trace.FromString(path.read_bytes())
    seqs: dict[int, dict] = {}
    tracks: dict[int, object] = {}
    stacks: dict[int, list] = defaultdict(list)
    slices = []
    primary_clock = None
    attrs = {}
    for pkt in trace.packet:
        sid = pkt.trusted_packet_sequence_id
        assert sid, "every packet needs a sequence id (interning and defaults are per sequence)"
        if sid not in seqs:
            assert pkt.sequence_flags & TracePacket.SEQ_INCREMENTAL_STATE_CLEARED, \
                "the first packet of a sequence must clear incremental state"
            seqs[sid] = {"tables": defaultdict(dict), "clock": 0, "track": 0, "clocks": {}, "last": None}
        st = seqs[sid]
        if pkt.HasField("trace_packet_defaults"):
            st["clock"] = pkt.trace_packet_defaults.timestamp_clock_id
            st["track"] = pkt.trace_packet_defaults.track_event_defaults.track_uuid
        for field in ("event_categories", "event_names", "debug_annotation_names"):
            for e in getattr(pkt.interned_data, field):
                assert e.iid not in st["tables"][field], "interned ids are never redefined"
                st["tables"][field][e.iid] = e.name
        for e in pkt.interned_data.debug_annotation_string_values:
            st["tables"]["strings"][e.iid] = e.str.decode()
        kind = pkt.WhichOneof("data")
        if kind == "clock_snapshot":
            clocks = {c.clock_id: c for c in pkt.clock_snapshot.clocks}
            assert BuiltinClock.BUILTIN_CLOCK_MONOTONIC in clocks
            if pkt.clock_snapshot.primary_trace_clock:
                primary_clock = pkt.clock_snapshot.primary_trace_clock
            for cid, c in clocks.items():
                if cid >= 64:
                    assert cid < 128 and c.is_incremental
                    # sequence clock == MONOTONIC: deltas convert to trace time without offset
                    assert c.timestamp == clocks[BuiltinClock.BUILTIN_CLOCK_MONOTONIC].timestamp
                    st["clocks"][cid] = c.timestamp
        elif kind == "track_descriptor":
            tracks[pkt.track_descriptor.uuid] = pkt.track_descriptor
        elif kind == "trace_attributes":
            attrs.update({a.key: a for a in pkt.trace_attributes.attribute})
        elif kind == "track_event":
            assert pkt.HasField("timestamp") and pkt.timestamp < 2 ** 63
            clock = pkt.timestamp_clock_id or st["clock"]
            assert clock in st["clocks"], "events use the sequence clock, snapshotted before them"
            st["clocks"][clock] += pkt.timestamp
            ts = st["clocks"][clock]
            te = pkt.track_event
            uuid = te.track_uuid if te.HasField("track_uuid") else st["track"]
            assert uuid in tracks and tracks[uuid].HasField("thread"), "slices go on known thread tracks"
            stack = stacks[uuid]
            if te.type == TrackEvent.TYPE_SLICE_BEGIN:
                cat = st["tables"]["event_categories"][te.category_iids[0]]
                name = st["tables"]["event_names"][te.name_iid]
                args = {}
                for a in te.debug_annotations:
                    key = st["tables"]["debug_annotation_names"][a.name_iid]
                    args[key] = (st["tables"]["strings"][a.string_value_iid]
                                 if a.WhichOneof("value") == "string_value_iid" else getattr(a, a.WhichOneof("value")))
                stack.append((ts, cat, name, args))
            else:
                assert te.type == TrackEvent.TYPE_SLICE_END and stack, "END must close an open slice"
                begin, cat, name, args = stack.pop()
                assert ts >= begin
                if stack:                   # strictly nested: inside the parent, which is still open
                    assert begin >= stack[-1][0]
                slices.append({"track": uuid, "ts": begin, "dur": ts - begin, "cat": cat, "name": name,
                               "args": args, "depth": len(stack)})
    assert primary_clock == BuiltinClock.BUILTIN_CLOCK_MONOTONIC
    assert not any(stacks.values()), "no slice may stay open"
    return {"slices": slices, "tracks": tracks, "attrs": attrs}


def test_perfetto_structure(tmp_path):
    p = synth(messy=True)
    path = tmp_path / "run.pftrace"
    write_perfetto(p, path)
    seen = check_trace_structure(path)
    slices = seen["slices"]
    by_cat = defaultdict(list)
    for s in slices:
        by_cat[s["cat"]].append(s)
    assert len(by_cat["llama_decode"]) == len(p.tokens)
    assert len(by_cat["graph"]) == len(p.graphs)
    assert len(by_cat["op"]) == len(p.ops)
    # a barrier is cut (possibly to nothing) where the next op starts before it ends
    assert 0 < len(by_cat["barrier"]) <= sum(1 for o in p.ops if o.barrier_end_ns > o.end_ns)
    # main thread nests token > graph > op
    main_track = next(u for u, d in seen["tracks"].items() if d.HasField("thread") and d.thread.tid == p.pid)
    assert {s["depth"] for s in by_cat["llama_decode"]} == {0}
    assert {s["depth"] for s in by_cat["graph"]} == {1}
    assert {s["depth"] for s in by_cat["op"] if s["track"] == main_track} == {2}
    tok = sorted(by_cat["llama_decode"], key=lambda s: s["ts"])[0]
    assert tok["name"] == "prefill" and tok["args"] == {"n_tokens": 7}
    op = next(s for s in by_cat["op"] if s["args"].get("addr"))
    assert {"tensor", "shape", "dtype", "cpu", "addr"} <= set(op["args"])
    assert set(op["args"]) - {"tensor", "shape", "dtype", "cpu", "addr"} <= {
        "src0", "src1", "src0_shape", "src0_dtype", "src0_view_of", "fused_tensor"}
    assert op["args"]["shape"].count("×") == 3
    # names and metadata that the UI shows
    threads = {d.thread.tid: d.thread.thread_name for d in seen["tracks"].values() if d.HasField("thread")}
    assert threads[p.pid] == "llama-cli" and threads[4242] == "idle-thread"
    procs = [d.process for d in seen["tracks"].values() if d.HasField("process")]
    assert [(x.pid, x.process_name) for x in procs] == [(p.pid, "llama-cli")]
    attrs = seen["attrs"]
    assert attrs["meta.model"].string_value == "/m/ünï.gguf"
    assert attrs["profinfer.lost_events"].long_value == 3


def test_perfetto_clean_profile_has_every_barrier(tmp_path):
    p = synth()
    path = tmp_path / "run.pftrace"
    write_perfetto(p, path)
    barriers = [s for s in check_trace_structure(path)["slices"] if s["cat"] == "barrier"]
    assert sorted(s["dur"] for s in barriers) == sorted(o.barrier_ns for o in p.ops if o.barrier_ns > 0)


def test_perfetto_is_compact(tmp_path):
    p = synth(n_tokens=10, n_threads=4, n_nodes=100)
    path = tmp_path / "run.pftrace"
    write_perfetto(p, path)
    assert path.stat().st_size / len(p.ops) < 120     # bytes per op, barrier included


# --------------------------------------------------------------------------- Perfetto: damage

def _expect_format_error(path):
    with pytest.raises(TraceFormatError) as e:
        read_trace(path)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg
    return msg


def test_corrupt_files_raise_trace_format_error(tmp_path):
    good = tmp_path / "good.pftrace"
    write_perfetto(synth(), good)
    data = good.read_bytes()
    cases = {
        "empty": b"",
        "text": b"hello, this is not a trace\n" * 20,
        "cli": b"\x0a\xff\xff\xff\x0fnot a trace at all" * 10,
        "random": random.Random(1).randbytes(5000),
        "cut_mid_packet": data[: len(data) // 2],
        "cut_before_footer": data[: data.rfind(b"\x0a", 0, len(data) - 20)],
    }
    for name, content in cases.items():
        bad = tmp_path / f"{name}.pftrace"
        bad.write_bytes(content)
        _expect_format_error(bad)


def test_cut_at_packet_boundary_is_detected(tmp_path):
    """Dropping whole packets at the end (lost footer) must not read as a shorter profile."""
    good = tmp_path / "good.pftrace"
    write_perfetto(synth(), good)
    trace = Trace.FromString(good.read_bytes())
    del trace.packet[-1]
    bad = tmp_path / "cut.pftrace"
    bad.write_bytes(trace.SerializeToString())
    assert "profinfer.format" in _expect_format_error(bad)


def test_foreign_perfetto_trace_is_rejected(tmp_path):
    b = TraceProtoBuilder()
    pkt = b.add_packet()
    pkt.trusted_packet_sequence_id = 1
    pkt.timestamp = 10
    pkt.track_event.type = TrackEvent.TYPE_INSTANT
    pkt.track_event.name = "x"
    path = tmp_path / "foreign.pftrace"
    path.write_bytes(b.serialize())
    _expect_format_error(path)


def test_mutated_files_never_raise_other_exceptions(tmp_path):
    good = tmp_path / "good.pftrace"
    write_perfetto(synth(n_tokens=3, n_nodes=4), good)
    data = bytearray(good.read_bytes())
    rnd = random.Random(7)
    bad = tmp_path / "bad.pftrace"
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rnd.randint(1, 4)):
            mutated[rnd.randrange(len(mutated))] = rnd.randrange(256)
        bad.write_bytes(bytes(mutated))
        try:
            assert isinstance(read_trace(bad), Profile)
        except TraceFormatError:
            pass


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "none.pftrace")


# --------------------------------------------------------------------------- Chrome JSON

def test_chrome_json(tmp_path):
    p = synth(messy=True)
    path = tmp_path / "run.json"
    write_chrome_json(p, path)
    text = path.read_text(encoding="utf-8")
    # trace_processor reads displayTimeUnit as the unit of ts, and rejects \\u escapes
    assert "displayTimeUnit" not in text and "\\u" not in text and "ünï" in text
    doc = json.loads(text)
    assert doc["metadata"]["meta.engine"] == "llama.cpp" and doc["metadata"]["lost_events"] == 3
    events = doc["traceEvents"]
    names = {(e["tid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert (p.pid, "llama-cli") in names
    xs = [e for e in events if e["ph"] == "X"]
    cats = defaultdict(int)
    for e in xs:
        cats[e["cat"]] += 1
        assert e["dur"] >= 0
    assert cats["llama_decode"] == len(p.tokens) and cats["graph"] == len(p.graphs)
    assert cats["op"] == len(p.ops)
    first_tok = min((e for e in xs if e["cat"] == "llama_decode"), key=lambda e: e["ts"])
    assert first_tok["ts"] == pytest.approx(p.tokens[0].start_ns / 1000)
    assert first_tok["args"]["n_tokens"] == 7
    # per thread, X events nest: sort by (start, -dur) and check with a stack
    by_tid = defaultdict(list)
    for e in xs:
        by_tid[e["tid"]].append((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)))
    for spans in by_tid.values():
        stack = []
        for s, e in sorted(spans, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= s:
                stack.pop()
            assert not stack or e <= stack[-1] + 1     # +1: µs float rounding
            stack.append(e)


def test_perfetto_counter_tracks(tmp_path):
    """Each op thread gets one counter track per counter under its thread track, and each
    counted op sets the counter to its delta at its start and back to 0 at its end."""
    p = synth(counters=True)
    path = tmp_path / "c.pftrace"
    write_perfetto(p, path)
    trace = Trace.FromString(path.read_bytes())
    tracks = {pk.track_descriptor.uuid: pk.track_descriptor for pk in trace.packet
              if pk.HasField("track_descriptor")}
    threads = {d.uuid: d.thread.tid for d in tracks.values() if d.HasField("thread")}
    counters = {u: d for u, d in tracks.items() if d.HasField("counter")}
    # task-clock also gives a derived track: CPU util % = task-clock / op duration
    names = p.counter_names + ["CPU util %"]
    assert {(threads[d.parent_uuid], d.name) for d in counters.values()} == {
        (tid, n) for tid in {o.tid for o in p.ops} for n in names}
    values = [(pk.track_event.track_uuid, pk.track_event.double_counter_value) for pk in trace.packet
              if pk.HasField("track_event") and pk.track_event.type == TrackEvent.TYPE_COUNTER]
    counted = [o for o in p.ops if o.counters is not None]
    assert len(values) == 2 * len(counted) * len(names)
    raw = [v for u, v in values if v and counters[u].name in p.counter_names]
    assert sorted(raw) == sorted(v for o in counted for v in o.counters if v)
    util = sorted(v for u, v in values if v and counters[u].name == "CPU util %")
    assert util == pytest.approx(sorted(100 * o.counters[0] / o.dur_ns for o in counted
                                        if o.counters[0] and o.dur_ns))
    attrs = {a.key: a for pk in trace.packet if pk.HasField("trace_attributes")
             for a in pk.trace_attributes.attribute}
    assert attrs["profinfer.counters"].string_value == "task-clock,r01a3"
    assert attrs["profinfer.counter_dropped.migrated"].long_value == sum(o.counters is None for o in p.ops)


def test_recording_without_events_is_written(tmp_path):
    """A command that failed before its first decode: no events, and a boot-clock offset read
    a few ns negative (two clock reads) must still give a trace, not a traceback."""
    p = Profile(pid=7, meta={"engine": "llama.cpp", "boottime_offset_ns": "-1555"})
    out = tmp_path / "empty.pftrace"
    write_perfetto(p, out)
    assert read_trace(out).tokens == []


# --------------------------------------------------------------------------- a plugin's own track

BEEP_PLUGIN = '''from profinfer.core.base.registry import Level

PLUGIN = Level("beeplevel", __name__, timeline="timeline")
'''
BEEP_TIMELINE = '''from dataclasses import dataclass

from profinfer.core.plugin.timeline import INT, LEVEL_RUNTIME, STR, SliceKind, Timeline


@dataclass
class Beep:
    tid: int
    start_ns: int
    end_ns: int
    pitch: int
    tone: str


class BeepKind(SliceKind):
    category, field = "beep", "beeps"

    def begin(self, obj):
        return "beep", obj.tone, (("pitch", INT, obj.pitch),)

    def read(self, reader, seq, start, ts, tid, name, begin_args, end_args):
        return Beep(tid, start, end_args.get("end_ns", ts), begin_args["pitch"], name)


class BeepTimeline(Timeline):
    kinds = (BeepKind(),)

    def slices(self, profile):
        for b in profile.records.get("beeps", []):
            yield self.kinds[0], b, LEVEL_RUNTIME


TIMELINE = BeepTimeline()
'''


def test_a_plugins_own_record_type_is_written_and_read_back(tmp_path, monkeypatch):
    """A level kept outside the tree, with a record type of its own, puts its slices in the
    trace and reads them back through its timeline module alone: no exporter, reader or
    model file names it. Without the plugin, the same trace is refused."""
    pkg = tmp_path / "plugins" / "beeplevel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(BEEP_PLUGIN)
    (pkg / "timeline.py").write_text(BEEP_TIMELINE)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    monkeypatch.setenv("PROFINFER_PLUGINS", "beeplevel")
    from beeplevel.timeline import Beep

    p = synth(n_tokens=3)
    op = next(o for o in p.ops if o.dur_ns > 10)
    cut = Beep(op.tid, op.start_ns, op.end_ns, 440, "la")          # cut short by the next one
    inside = Beep(op.tid, op.start_ns + 1, op.start_ns + 5, 220, "low")
    alone = Beep(4242, 10, 20, 1, "idle")                           # a thread with no op
    p.records["beeps"] = [alone, cut, inside]
    path = tmp_path / "b.pftrace"
    write_perfetto(p, path)
    seen = check_trace_structure(path)
    beeps = [s for s in seen["slices"] if s["cat"] == "beep"]
    assert sorted((s["name"], s["args"]["pitch"]) for s in beeps) == [("idle", 1), ("la", 440), ("low", 220)]
    assert all(s["depth"] == 3 for s in beeps if s["name"] != "idle")   # under token > graph > op
    assert next(s for s in beeps if s["name"] == "la")["dur"] == 1
    assert read_trace(path) == p

    chrome = tmp_path / "b.json"
    write_chrome_json(p, chrome)
    events = [e for e in json.loads(chrome.read_text())["traceEvents"] if e.get("cat") == "beep"]
    assert sorted(e["name"] for e in events) == ["idle", "la", "low"]

    monkeypatch.delenv("PROFINFER_PLUGINS")
    with pytest.raises(TraceFormatError, match="unknown slice category 'beep'"):
        read_trace(path)


def test_decode_call_timeline_is_bounded_and_keeps_the_totals():
    """Up to MAX_TIMELINE_POINTS calls: one entry each; more: consecutive groups of k calls,
    which keep the calls' count, tokens and own time, and start and end where their calls do."""
    from profinfer.core.plugin.timeline_groups import MAX_TIMELINE_POINTS
    small = synth(n_tokens=5, n_nodes=2)
    s = summary(small)
    assert s["decode_call_group"] == 1
    assert [(c["start_ns"], c["end_ns"], c["tokens"], c["phase"]) for c in s["decode_call_list"]] == [
        (t.start_ns, t.end_ns, t.n_tokens, "prefill" if t.prefill else "decode") for t in small.tokens]
    n = 2 * MAX_TIMELINE_POINTS + 3
    calls = [TokenCall(tid=1, start_ns=100 * i, end_ns=100 * i + 7 + i % 5, n_tokens=1 + i % 3, prefill=i < 4)
             for i in range(n)]
    s = summary(Profile(pid=1, tokens=calls))
    groups = s["decode_call_list"]
    assert s["decode_call_group"] == 3 and len(groups) == -(-n // 3) <= MAX_TIMELINE_POINTS
    assert sum(g["calls"] for g in groups) == n
    assert sum(g["tokens"] for g in groups) == sum(c.n_tokens for c in calls)
    assert sum(g["dur_ns"] for g in groups) == sum(c.end_ns - c.start_ns for c in calls)
    assert groups[0]["phase"] == "prefill" and groups[1]["phase"] == "mixed" and groups[2]["phase"] == "decode"
    assert groups[-1]["end_ns"] == calls[-1].end_ns and groups[1]["start_ns"] == calls[3].start_ns
