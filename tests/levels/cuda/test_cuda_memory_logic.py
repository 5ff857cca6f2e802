"""Live device memory, its peak and what was never freed, from allocation and free calls
(pure logic: this machine has no GPU, so its runtime's allocations all fail; the recorded
tests check that failed ones count as nothing)."""
from profinfer.levels.cuda.stats import live_memory, summary
from profinfer.levels.cuda.records import CudaCall


def _call(t, api, ptr, size=0, ret=0, memory="device"):
    return CudaCall(1, 1, api, "memory", t, t + 1, bytes=size, copy_kind=memory, ptr=ptr, ret=ret,
                    caller="main+0x10")


def test_live_peak_and_leaks():
    calls = [_call(1, "cudaMalloc", 0xA, 100), _call(2, "cudaMalloc", 0xB, 50),
             _call(3, "cudaFree", 0xA), _call(4, "cudaMalloc", 0xC, 30, ret=2),   # failed: nothing
             _call(5, "cudaMallocAsync", 0xD, 70), _call(6, "cudaFreeAsync", 0xD),
             _call(7, "cudaMallocHost", 0xE, 999, memory="host"), _call(8, "cudaFree", 0xF)]  # unknown free
    series, peak, leaks = live_memory(calls)
    assert [v for _, v in series] == [100, 150, 50, 120, 50]
    assert peak == 150
    assert [(c.ptr, c.bytes) for c in leaks] == [(0xB, 50)]
    m = summary(calls)["memory"]
    assert m["failed"] == 1 and m["device_live_bytes_at_end"] == 50
    assert {(x["ptr"], x["memory"]) for x in m["not_freed"]} == {("0xb", "device"), ("0xe", "host")}
    assert all(x["site"] == "main+0x10" for x in m["not_freed"])


def test_default_copies_resolved_only_between_known_allocations():
    from profinfer.levels.cuda.collector import KnownMemory
    from profinfer.levels.cuda.runtime import Api
    malloc = Api(0, "cudaMalloc", "malloc", "memory", None, None, "device", True)
    host = Api(1, "cudaMallocHost", "malloc", "memory", None, None, "host", True)
    free = Api(2, "cudaFree", "free", "memory", None, None, "device", True)
    m = KnownMemory()
    m.note(malloc, 7, 0x1000, 0x100, 1)
    m.note(host, 7, 0x9000, 0x100, 2)
    assert m.resolve(7, 0x1010, 0x9000, "Default") == "Default:H2D"
    assert m.resolve(7, 0x9010, 0x10ff, "Default") == "Default:D2H"
    assert m.resolve(7, 0x1010, 0x5555, "Default") == "Default"       # an unknown source
    assert m.resolve(8, 0x1010, 0x9000, "Default") == "Default"       # another process's
    assert m.resolve(7, 0x1010, 0x9000, "H2D") == "H2D"
    m.note(free, 7, 0x1000, 0, 1)
    assert m.resolve(7, 0x1010, 0x9000, "Default") == "Default"


def test_trace_live_memory_counter_ends_at_what_was_never_freed(tmp_path):
    """The exporter's counter track, written and read back (successful allocations need a
    GPU: here they are made up, the writing and reading are real)."""
    from profinfer.exporters.perfetto import LIVE_MEMORY_TRACK, write_perfetto
    from profinfer.exporters.trace_reader import read_named_tracks, read_trace
    from profinfer.core.profile.model import Profile
    calls = [_call(10, "cudaMalloc", 0xA, 100), _call(20, "cudaMalloc", 0xB, 50),
             _call(30, "cudaFree", 0xA), _call(40, "cudaMallocAsync", 0xD, 70)]
    prof = Profile(pid=1, process_name="p", cuda_calls=calls)
    path = tmp_path / "t.pftrace"
    write_perfetto(prof, path)
    assert read_named_tracks(path)[(1, LIVE_MEMORY_TRACK)] == [0, 100, 150, 50, 120]
    back = read_trace(path)
    assert [(c.api, c.ptr, c.bytes, c.copy_kind) for c in back.cuda_calls] == \
        [(c.api, c.ptr, c.bytes, c.copy_kind) for c in calls]
