"""scripts/trace_summary.py on synthetic traces, a CPU TraceRecorder trace, and bad files."""
from __future__ import annotations

import copy
import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("redline_trace_summary", ROOT / "scripts" / "trace_summary.py")
ts = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ts  # dataclasses look the module up while the class is built
_spec.loader.exec_module(ts)

CPU, GPU = 100, 0  # pids
LONG_NAME = "void very_long_templated_kernel_name<" + "float, " * 20 + ">(int)"


def X(name, cat, ts_, dur, pid=GPU, tid=7, **kw):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts_, "dur": dur, "pid": pid, "tid": tid, **kw}


def synthetic_trace() -> dict:
    """4 decode steps (period 100 us).  Times in us.

    CPU slices  redline.decode_step: [1000+100i, +80]            -> CPU window [1000, 1380]
    GPU annot.  redline.decode_step: [1010+100i, +60] (stream 7) -> GPU window [1010, 1370] = 360
    kernels per step: A [1010+100i, +30], B [1045+100i, +20]     -> 50 busy per step
    C [1365, +30] (clipped to 5 in the GPU window), memset [1075, +5] in a gap,
    memcpy [1015, +10] overlapping A (no extra busy), prefill kernel P [500, +100] (outside).
    busy = 200 + 5 + 5 = 210 -> 58.333 %; gaps = 150 us = 0.0375 ms/step.
    """
    ev = [
        {"ph": "M", "name": "process_name", "pid": CPU, "args": {"name": "python"}},
        X("redline.prefill", "user_annotation", 400, 300, pid=CPU, tid=1),
        X(LONG_NAME, "kernel", 500, 100),  # "P": prefill kernel
        X("cudaGraphLaunch", "cuda_runtime", 900, 4, pid=CPU, tid=1),  # before the window
        X("C_kernel", "kernel", 1365, 30),
        X("Memset (Device)", "gpu_memset", 1075, 5, tid=8),
        X("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 1015, 10, tid=8),
        X("cudaGraphLaunch", "cuda_runtime", 1390, 4, pid=CPU, tid=1),  # after the window
    ]
    for i in range(4):
        o = 100 * i
        ev += [
            X("redline.decode_step", "user_annotation", 1000 + o, 80, pid=CPU, tid=1),
            X("redline.decode_step", "gpu_user_annotation", 1010 + o, 60),
            X("A_kernel", "kernel", 1010 + o, 30),
            X("B_kernel", "kernel", 1045 + o, 20),
            X("cudaGraphLaunch", "cuda_runtime", 1005 + o, 4, pid=CPU, tid=1),
            X("cuGraphLaunch", "cuda_driver", 1006 + o, 2, pid=CPU, tid=1),  # nested: not counted twice
            X("cudaLaunchKernel", "cuda_runtime", 1002 + o, 2, pid=CPU, tid=1),
        ]
    ev += [
        {"ph": "C", "name": "tokens/sec", "pid": CPU, "ts": 1080, "args": {"tokens/sec": 100.0}},
        {"ph": "C", "name": "tokens/sec", "pid": CPU, "ts": 1180, "args": {"tokens/sec": 300.0}},
    ]
    return {"traceEvents": ev, "redline": {"stats": {"decode_tok_s": 42.0, "model": "tiny"}, "format": 1}}


def strip(trace: dict, *, stats=False, counters=False, gpu_annot=False, cpu_annot=False, kernels=False) -> dict:
    t = copy.deepcopy(trace)
    if stats:
        t.pop("redline")
    keep = []
    for e in t["traceEvents"]:
        if counters and e.get("ph") == "C":
            continue
        if gpu_annot and e.get("cat") == "gpu_user_annotation":
            continue
        if cpu_annot and e.get("cat") == "user_annotation":
            continue
        if kernels and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        keep.append(e)
    t["traceEvents"] = keep
    return t


def test_full_synthetic_trace():
    s = ts.summarize_trace(synthetic_trace())
    assert s.tok_s == 42.0 and s.tok_s_source == "redline.stats"
    assert s.window_source == "gpu_user_annotation"
    assert (s.window_start_us, s.window_end_us) == (1010, 1370)
    assert s.window_ms == pytest.approx(0.360)
    assert s.steps == 4
    assert s.step_ms_mean == pytest.approx(0.060) and s.step_ms_median == pytest.approx(0.060)
    assert s.has_gpu_activity
    assert s.gpu_busy_ms == pytest.approx(0.210)
    assert s.gpu_busy_pct == pytest.approx(100 * 210 / 360)
    assert s.gap_ms == pytest.approx(0.150)
    assert s.gap_ms_per_step == pytest.approx(0.0375)
    assert s.kernels_scope == "decode window"
    assert [(k.name, k.count) for k in s.top_kernels] == [("A_kernel", 4), ("B_kernel", 4), ("C_kernel", 1)]
    a, b, c = s.top_kernels
    assert (a.total_us, a.mean_us) == (120, 30) and (b.total_us, b.mean_us) == (80, 20) and c.total_us == 30
    assert a.share_pct == pytest.approx(100 * 120 / 230) and c.share_pct == pytest.approx(100 * 30 / 230)
    assert s.kernel_total_ms == pytest.approx(0.230)
    assert s.graph_launches == 4 and s.graph_launches_per_step == 1.0

    text = ts.format_summary(s)
    assert "tokens/sec: 42.00" in text
    assert "4 steps" in text and "GPU-side annotations" in text
    assert "58.3%" in text and "gaps 0.150 ms total, 0.037 ms/step" in text
    assert "1.00 per step" in text
    assert text.index("A_kernel") < text.index("B_kernel") < text.index("C_kernel")


def test_tok_s_from_counter_and_not_recorded():
    s = ts.summarize_trace(strip(synthetic_trace(), stats=True))
    assert s.tok_s == pytest.approx(200.0) and s.tok_s_source == "counter"
    s = ts.summarize_trace(strip(synthetic_trace(), stats=True, counters=True))
    assert s.tok_s is None
    assert "tokens/sec: not recorded" in ts.format_summary(s)


def test_cpu_annotations_when_no_gpu_annotations():
    s = ts.summarize_trace(strip(synthetic_trace(), gpu_annot=True))
    assert s.window_source == "cpu_annotation"
    assert s.window_ms == pytest.approx(0.380)  # [1000, 1380]
    assert s.steps == 4 and s.step_ms_mean == pytest.approx(0.080)
    busy = 200 + 15 + 5  # C clipped to [1365, 1380], memset
    assert s.gpu_busy_pct == pytest.approx(100 * busy / 380)
    assert s.gap_ms == pytest.approx((380 - busy) / 1000)
    assert s.graph_launches_per_step == 1.0


def test_trace_without_redline_labels_uses_kernel_span():
    s = ts.summarize_trace(strip(synthetic_trace(), stats=True, counters=True, gpu_annot=True, cpu_annot=True))
    assert s.window_source == "gpu_kernels"
    assert (s.window_start_us, s.window_end_us) == (500, 1395)
    assert s.steps is None and s.step_ms_mean is None and s.gap_ms_per_step is None
    busy = 100 + 200 + 30 + 5
    assert s.gpu_busy_pct == pytest.approx(100 * busy / 895)
    assert s.kernels_scope == "whole trace"
    assert [k.name for k in s.top_kernels] == ["A_kernel", LONG_NAME, "B_kernel", "C_kernel"]
    assert s.graph_launches == 6 and s.graph_launches_per_step is None
    text = ts.format_summary(s)
    assert "span of all GPU kernels" in text
    assert "graph launches: 6" in text
    # long kernel names are truncated to 80 characters
    (line,) = [ln for ln in text.splitlines() if "very_long_templated" in ln]
    assert line.endswith("...") and len(line.rsplit("  ", 1)[1]) == 80


def test_cpu_only_trace():
    s = ts.summarize_trace(strip(synthetic_trace(), gpu_annot=True, kernels=True))
    assert not s.has_gpu_activity
    assert s.gpu_busy_pct is None and s.top_kernels == []
    assert s.window_source == "cpu_annotation" and s.steps == 4
    assert "no GPU activity in trace" in ts.format_summary(s)


def test_gpu_annotations_use_the_busiest_stream():
    t = synthetic_trace()
    t["traceEvents"].append(X("redline.decode_step", "gpu_user_annotation", 1015, 5, tid=8))
    s = ts.summarize_trace(t)
    assert s.steps == 4 and (s.window_start_us, s.window_end_us) == (1010, 1370)


def test_driver_graph_launches_counted_without_runtime_ones():
    t = synthetic_trace()
    t["traceEvents"] = [e for e in t["traceEvents"] if e.get("name") != "cudaGraphLaunch"]
    s = ts.summarize_trace(t)
    assert s.graph_launches == 4  # cuGraphLaunch (cuda_driver) in the window


def test_hip_graph_launches_counted_as_graph_launches():
    # ROCm traces name the runtime call hipGraphLaunch (category cuda_runtime, as kineto files HIP calls)
    t = synthetic_trace()
    events = []
    for e in t["traceEvents"]:
        if e.get("name") == "cuGraphLaunch":
            continue
        if e.get("name") == "cudaGraphLaunch":
            e = {**e, "name": "hipGraphLaunch"}
        events.append(e)
    t["traceEvents"] = events
    s = ts.summarize_trace(t)
    assert s.graph_launches == 4  # the two outside the decode window are not counted
    assert s.graph_launches_per_step == 1.0
    assert "1.00 per step" in ts.format_summary(s)


def test_cli_json_bare_list_and_top(tmp_path, capsys):
    path = tmp_path / "list.json"
    path.write_text(json.dumps(synthetic_trace()["traceEvents"]))  # bare-list format, not gzipped
    assert ts.main([str(path), "--json", "--top", "2"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert d["tok_s"] == pytest.approx(200.0)  # no top-level stats in list format: the counter
    assert [k["name"] for k in d["top_kernels"]] == ["A_kernel", "B_kernel"]
    assert d["top_kernels"][0]["share_pct"] == pytest.approx(100 * 120 / 230)
    assert d["graph_launches_per_step"] == 1.0


def test_cli_text_gzip(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(synthetic_trace()).encode()))
    assert ts.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trace: {path}")
    assert "tokens/sec: 42.00 (redline stats)" in out
    assert "run: model=tiny" in out


def test_round_trip_trace_recorder(tmp_path):
    from redline.profiling import ProfileConfig, TraceRecorder

    w = torch.randn(32, 32)
    rec = TraceRecorder(ProfileConfig(tmp_path / "rt.json.gz", record_steps=3), "cpu")
    secs = []
    with rec:
        with rec.region("prefill"):
            h = torch.randn(4, 32) @ w
        rec.step()
        for _ in range(6):
            with rec.region("decode_step"):
                h = torch.tanh(h @ w)
            secs.append(0.01)
            rec.step()
    stats = {"decode_tok_s": 77.25, "model": "tiny", "new_tokens": 7}
    path = rec.write(stats, secs)
    s = ts.summarize_trace(path)
    assert s.tok_s == 77.25 and s.tok_s_source == "redline.stats"
    assert s.stats == stats
    assert s.steps == 3 and s.window_source == "cpu_annotation"
    assert not s.has_gpu_activity
    s2 = ts.summarize_trace(strip(json.loads(gzip.decompress(path.read_bytes())), stats=True))
    assert s2.tok_s == pytest.approx(100.0)  # mean of the tokens/sec counter (1 / 0.01)


def _bad_files(tmp_path):
    good_gz = gzip.compress(json.dumps(synthetic_trace()).encode())
    cases = {
        "missing": None,
        "empty": b"",
        "corrupt_gzip": b"\x1f\x8b\x08\x00garbage-not-deflate",
        "truncated_gzip": good_gz[: len(good_gz) // 2],
        "gzip_of_nothing": gzip.compress(b""),
        "not_json": b"hello, world",
        "binary": bytes(range(256)),
        "no_events_key": b'{"foo": 1}',
        "empty_events": b'{"traceEvents": []}',
        "json_number": b"3",
    }
    out = {}
    for name, data in cases.items():
        p = tmp_path / f"{name}.json.gz"
        if data is not None:
            p.write_bytes(data)
        out[name] = p
    out["directory"] = tmp_path
    return out


@pytest.mark.parametrize(
    "case",
    ["missing", "empty", "corrupt_gzip", "truncated_gzip", "gzip_of_nothing", "not_json", "binary",
     "no_events_key", "empty_events", "json_number", "directory"],
)
def test_bad_files_exit_2_with_one_line(tmp_path, capsys, case):
    path = _bad_files(tmp_path)[case]
    assert ts.main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err


def test_exclusive_time_counts_overlapping_kernels_once():
    """With programmatic dependent launch a kernel starts before the previous one ends: its duration then
    includes waiting, and the exclusive time (end minus the previous end) is what it adds to the timeline."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "attn", "ts": 4, "dur": 9},  # overlaps: adds 3
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 20, "dur": 5},  # after a gap of 7: adds 5
        {"ph": "X", "cat": "kernel", "name": "attn", "ts": 21, "dur": 2},  # inside the previous kernel: adds 0
    ]
    s = ts.summarize_trace({"traceEvents": events})
    stats = {k.name: k for k in s.top_kernels}
    assert stats["gemv"].total_us == 15 and stats["gemv"].exclusive_us == 15
    assert stats["attn"].total_us == 11 and stats["attn"].exclusive_us == 3 and stats["attn"].exclusive_mean_us == 1.5
    assert "excl us" in ts.format_summary(s)


def test_roles_label_call_sites_within_each_step(capsys):
    """Three calls of one kernel per step labelled a, b and a tail; exclusive times per label."""
    ev = []
    for i in range(2):
        o = 100 * i
        ev += [
            X("redline.decode_step", "gpu_user_annotation", o, 90),
            X("gemv", "kernel", o, 10),  # a: adds 10
            X("gemv", "kernel", o + 8, 6),  # b: overlaps, adds 4
            X("gemv", "kernel", o + 20, 5),  # third call: no whole cycle of (a, b) left -> tail, adds 5
        ]
    s = ts.summarize_trace({"traceEvents": ev}, roles=ts.parse_roles("gemv=a,b"))
    got = {r.role: (r.calls_per_step, r.exclusive_mean_us, r.exclusive_per_step_us) for r in s.roles}
    assert got == {"a": (1.0, 10.0, 10.0), "b": (1.0, 4.0, 4.0), "gemv#tail": (1.0, 5.0, 5.0)}
    assert "call sites" in ts.format_summary(s)
    with pytest.raises(ts.TraceError, match="KERNEL=label1"):
        ts.parse_roles("gemv")
    with pytest.raises(ts.TraceError, match="GPU-side"):
        ts.summarize_trace({"traceEvents": [X("gemv", "kernel", 0, 1)]}, roles=("gemv", ["a"]))


def test_all_reduce_kernels_per_decode_step():
    """NCCL's and the one-shot's kernels in the decode window: per-step duration and time added to the timeline."""
    ev = []
    for i in range(2):
        o = 100 * i
        ev += [
            X("redline.decode_step", "gpu_user_annotation", o, 90),
            X("gemv", "kernel", o, 10),
            X("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", o + 10, 8),
            X("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 2>", "kernel", o + 15, 6),
        ]
    s = ts.summarize_trace({"traceEvents": ev})
    assert s.all_reduce_calls_per_step == 2.0
    assert s.all_reduce_us_per_step == 14.0 and s.all_reduce_exclusive_us_per_step == 11.0  # 8 + (21 - 18)
    assert "all-reduce: 2.0 kernels per step, 14.0 us/step (11.0 us/step added" in ts.format_summary(s)
    assert ts.summarize_trace(synthetic_trace()).all_reduce_us_per_step is None  # one process: no all-reduce


def test_a_gzip_that_expands_past_the_limit_is_one_line(tmp_path, capsys, monkeypatch):
    import gzip as gz

    from redline.scripts import trace_summary

    monkeypatch.setattr(trace_summary, "MAX_TRACE_BYTES", 1 << 20)
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gz.compress(b'{"traceEvents": [' + b" " * (64 << 20) + b"]}"))  # 64 KB -> 64 MB
    assert bomb.stat().st_size < 1 << 20
    assert trace_summary.main([str(bomb)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "expands to more than 1 MiB" in err and err.count("\n") == 1
    big = tmp_path / "big.json"
    big.write_bytes(b'{"traceEvents": [' + b" " * (2 << 20) + b"]}")
    assert trace_summary.main([str(big)]) == 2
    assert "larger than 1 MiB" in capsys.readouterr().err
