"""viewers.optable renders the report tables from a synthetic profile."""
from __future__ import annotations

from rich.console import Console

from profinfer.core.profile.model import GraphCall, OpSlice, Profile, TokenCall
from profinfer.viewers.optable import render


def profile() -> Profile:
    ops = [OpSlice(1, 0, 1_000, 3_001_000, 3_500_000, "MUL_MAT", "ffn_up-0", (4096, 11008, 1, 1), "q4_0"),
           OpSlice(2, 1, 1_000, 2_000_000, 3_500_000, "MUL_MAT", "ffn_up-0", (4096, 11008, 1, 1), "q4_0"),
           OpSlice(1, 0, 3_500_000, 3_600_000, 3_700_000, "RMS_NORM+MUL", "norm-0", (4096, 1, 1, 1), "f32"),
           OpSlice(1, 0, 5_100_000, 5_400_000, 5_400_000, "MUL_MAT", "ffn_up-0", (4096, 11008, 1, 1), "q4_0")]
    return Profile(pid=1, process_name="llama-cli", thread_names={1: "llama-cli", 2: "worker-1"},
                   tokens=[TokenCall(1, 0, 4_000_000, 8, True), TokenCall(1, 5_000_000, 5_500_000, 1, False)],
                   graphs=[GraphCall(1, 0, 3_800_000, "CPU", 2), GraphCall(1, 5_050_000, 5_450_000, "CPU", 1)],
                   ops=ops, lost_events=12)


def rendered(p: Profile) -> str:
    console = Console(record=True, width=200, color_system=None)
    render(p, console)
    return console.export_text()


def test_op_table_rows_sorted_by_total():
    text = rendered(profile())
    assert "Operators" in text
    assert text.index("MUL_MAT") < text.index("RMS_NORM+MUL")
    mm = next(line for line in text.splitlines() if "MUL_MAT" in line and "│" in line)
    cells = [c.strip() for c in mm.split("│") if c.strip()]
    # count, total ms, mean µs, p50 µs, p99 µs, share %
    assert cells[:3] == ["MUL_MAT", "3", "5.299"]
    assert cells[3] == "1,766.3" and cells[4] == "1,999.0"
    assert cells[-1] == "98.1"


def test_phase_table_and_latency_line():
    text = rendered(profile())
    assert "Phases" in text and "prefill" in text and "decode" in text
    assert "TTFT 4.000 ms" in text
    assert "TPOT 1.500 ms" in text          # (5.5 ms - 4.0 ms) / 1 decode token
    assert "2,000.00 tokens/s" in text       # 1 token / 0.5 ms
    assert "lost events 12" in text and "warning: 12 events were lost" in text


def test_thread_table():
    text = rendered(profile())
    assert "Threads" in text
    main = next(line for line in text.splitlines() if "llama-cli" in line and "│" in line)
    cells = [c.strip() for c in main.split("│") if c.strip()]
    # graph ms: both graphs whole, 3.8 + 0.4; arrival: both threads started graph 1 at 1 µs;
    # op 3.0 + 0.1 + 0.3; barrier 0.499 + 0.1; coverage (arrival + op + barrier) / graph
    assert cells == ["1", "llama-cli", "4.200", "0.000", "3.400", "0.599", "95.2"]
    assert "worker-1" in text


def test_empty_profile_renders():
    text = rendered(Profile(pid=1))
    assert "TTFT - ms" in text and "tokens/s" in text
