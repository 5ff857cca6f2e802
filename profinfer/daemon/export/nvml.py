"""GPU metrics from NVML (nvidia-ml-py) where a driver is present, sampled in a thread of their
own (an NVML call can block: a GPU fallen off the bus) and named so that a DCGM exporter user
finds their way (the DCGM field each matches is in its help text); without a driver they are
off, said once."""
from __future__ import annotations

import threading
import time

from prometheus_client.core import GaugeMetricFamily

from profinfer.core.base.waits import NVML_STALL_S


_nvml = {"state": None, "tried": 0.0, "driver": ""}
NVML_RETRY_S = 60.0      # a driver loaded after the daemon started is found within this


def _why(e: Exception) -> str:
    """An NVML failure in words, one line."""
    import pynvml
    if isinstance(e, pynvml.NVMLError_LibraryNotFound):
        return "no NVIDIA driver library (libnvidia-ml.so.1 not found)"
    if isinstance(e, pynvml.NVMLError):
        return f"NVML: {e}"
    return f"NVML: {type(e).__name__}: {e}"


def _nvml_init() -> str:
    """"on", or "off: why" (the agent says it once, at each change); tried again now and then."""
    now = time.monotonic()
    if _nvml["state"] != "on" and (_nvml["state"] is None or now - _nvml["tried"] >= NVML_RETRY_S):
        _nvml["tried"] = now
        try:
            import pynvml
        except ImportError:
            _nvml["state"] = "off: nvidia-ml-py is not installed"
            return _nvml["state"]
        try:
            pynvml.nvmlInit()
            _nvml["state"] = "on"
        except Exception as e:        # NVMLError (no library, no driver), or worse: GPU metrics off
            _nvml["state"] = f"off: {_why(e)}"
            return _nvml["state"]
        try:
            _nvml["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:
            _nvml["driver"] = ""
    return _nvml["state"]


def _nvml_lost(e: Exception) -> str:
    """NVML stopped answering while on (a driver unloaded, a fatal error): off, tried again later."""
    import pynvml
    try:
        pynvml.nvmlShutdown()
    except Exception:
        pass
    _nvml["state"] = f"off: NVML stopped answering ({_why(e)})"
    _nvml["tried"] = time.monotonic()
    return _nvml["state"]


def _memory_info(h):
    """Memory as nvidia-smi and DCGM count it: used without the driver's reserved memory
    (NVML's v2 query); a driver before it (R510) answers the v1 query, where used includes it."""
    import pynvml
    older = tuple(getattr(pynvml, n) for n in ("NVMLError_FunctionNotFound", "NVMLError_NotSupported",
                                                "NVMLError_ArgumentVersionMismatch") if hasattr(pynvml, n))
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    except older:
        return pynvml.nvmlDeviceGetMemoryInfo(h)


def gpu_sample() -> tuple[str, list[dict], dict[str, str]]:
    """(state, each device's values, why a device answered in part or not at all). A query a
    device does not support (power on some boards, MIG) is left out quietly; any other failure
    leaves its values out and is said, by device; nothing here raises."""
    state = _nvml_init()
    if state != "on":
        return state, [], {}
    import pynvml
    try:
        count = pynvml.nvmlDeviceGetCount()
    except Exception as e:
        return _nvml_lost(e), [], {}
    out, problems = [], {}
    for i in range(count):
        errors: list[str] = []

        def query(fn, *args):
            try:
                return fn(*args)
            except pynvml.NVMLError_NotSupported:
                return None
            except Exception as e:    # NVMLError (GPU is lost...), or a malformed answer
                errors.append(_why(e))
                return None

        h = query(pynvml.nvmlDeviceGetHandleByIndex, i)
        if h is None:
            problems[str(i)] = errors[0] if errors else "no handle"
            continue
        uuid = query(pynvml.nvmlDeviceGetUUID, h)
        util = query(pynvml.nvmlDeviceGetUtilizationRates, h)
        mem = query(_memory_info, h)
        power = query(pynvml.nvmlDeviceGetPowerUsage, h)
        procs: dict[int, int] = {}
        for p in query(pynvml.nvmlDeviceGetComputeRunningProcesses, h) or []:
            if p.usedGpuMemory is not None:   # not available (MIG, WDDM): left out, not 0
                procs[p.pid] = procs.get(p.pid, 0) + p.usedGpuMemory   # once per pid
        if errors:
            problems[str(i)] = errors[0]
        out.append({"gpu": str(i), "uuid": uuid or "",
                    "util": None if util is None else util.gpu / 100,
                    "used": None if mem is None else mem.used, "total": None if mem is None else mem.total,
                    "power": None if power is None else power / 1000,
                    "processes": sorted(procs.items())})
    return state, out, problems


class GpuSampler:
    """gpu_sample() once a second in a thread of its own: an NVML call that blocks (the
    driver waiting on a GPU that stopped responding can take minutes) holds up neither the
    agent's loop nor /healthz. The latest sample is read; a sample running for NVML_STALL_S
    turns GPU metrics off until NVML answers again."""

    def __init__(self, period_s: float = 1.0, first_wait_s: float = 3 * NVML_STALL_S):
        self.period_s = period_s
        self.result: tuple[str, list[dict], dict[str, str]] | None = None
        self.since = time.monotonic()          # when the sample under way began
        self.first = threading.Event()
        threading.Thread(target=self._run, name="nvml", daemon=True).start()
        self.first.wait(first_wait_s)          # the daemon's first word on GPUs is NVML's answer

    def _run(self) -> None:
        while True:
            self.since = time.monotonic()
            try:
                self.result = gpu_sample()
            except Exception as e:             # gpu_sample raises nothing; a bug is not fatal
                self.result = (f"off: NVML: {type(e).__name__}: {e}", [], {})
            self.since = time.monotonic()
            self.first.set()
            time.sleep(self.period_s)

    def latest(self) -> tuple[str, list[dict], dict[str, str]]:
        if self.result is None or time.monotonic() - self.since >= NVML_STALL_S:
            return f"off: NVML has not answered for {NVML_STALL_S:g} s (a call blocks)", [], {}
        return self.result


def gpu_changes(old_state: str | None, state: str, old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What the log says when NVML's state or a device's trouble changed (once each)."""
    lines = []
    if state != old_state:
        if state == "on":
            lines.append("GPU metrics on: NVML answers" + (f" (driver {_nvml['driver']})" if _nvml["driver"] else ""))
        else:
            again = ("back when the call returns" if "has not answered" in state
                     else f"NVML tried again every {NVML_RETRY_S:g} s")
            lines.append(f"GPU metrics are off: {state.removeprefix('off: ')}; the daemon's other metrics "
                         f"are unaffected ({again})")
    for gpu in sorted(set(old) | set(new), key=int):
        if new.get(gpu) == old.get(gpu):
            continue
        if gpu in new:
            lines.append(f"GPU {gpu}: {new[gpu]} (what it does not answer is left out)")
        elif state == "on":
            lines.append(f"GPU {gpu}: answers again")
    return lines


def gpu_families(gpus: list[dict]):
    if not gpus:
        return
    util = GaugeMetricFamily("profinfer_gpu_utilization_ratio", "GPU busy share over the last "
                             "sample period (DCGM_FI_DEV_GPU_UTIL / 100)", labels=["gpu", "uuid"])
    used = GaugeMetricFamily("profinfer_gpu_memory_used_bytes", "GPU memory used (DCGM_FI_DEV_FB_USED, "
                             "in bytes)", labels=["gpu", "uuid"])
    total = GaugeMetricFamily("profinfer_gpu_memory_total_bytes", "GPU memory (DCGM_FI_DEV_FB_TOTAL, "
                              "in bytes)", labels=["gpu", "uuid"])
    power = GaugeMetricFamily("profinfer_gpu_power_watts", "GPU power draw (DCGM_FI_DEV_POWER_USAGE)",
                              labels=["gpu", "uuid"])
    pmem = GaugeMetricFamily("profinfer_gpu_process_memory_bytes", "GPU memory a process uses "
                             "(NVML's compute processes; host pids)", labels=["gpu", "uuid", "pid"])
    for g in gpus:
        lv = [g["gpu"], g["uuid"]]
        for fam, key in ((util, "util"), (used, "used"), (total, "total"), (power, "power")):
            if g[key] is not None:
                fam.add_metric(lv, g[key])
        for pid, b in g["processes"]:
            pmem.add_metric(lv + [str(pid)], b)
    yield from (util, used, total, power, pmem)

