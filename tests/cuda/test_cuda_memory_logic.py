"""Live device memory, its peak and what was never freed, from allocation and free calls
(pure logic: this machine has no GPU, so its runtime's allocations all fail; the recorded
tests check that failed ones count as nothing)."""
from profinfer.cuda.stats import live_memory, summary
from profinfer.model import CudaCall


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
