"""profiling.py: ProfileConfig validation and TraceRecorder export on the CPU."""
from __future__ import annotations

import gzip
import json
import time
import warnings
from pathlib import Path

import pytest
import torch

from redline.profiling import ProfileConfig, TraceRecorder

STATS = {
    "model": "tiny",
    "dtype": "float32",
    "quantization": "none",
    "device": "cpu",
    "torch_version": torch.__version__,
    "ttft_s": 0.25,
    "decode_tok_s": 123.5,
    "prefill_tok_s": 800.0,
    "bandwidth_gb_s": 1.5,
    "prompt_tokens": 7,
    "new_tokens": 21,
    "peak_memory_gb": 0.0,
}


def run_fake_generation(path: Path, decode_steps: int, record_steps: int):
    """The engine's calling pattern: prefill, step(), then decode steps each followed by step()."""
    w = torch.randn(64, 64)
    rec = TraceRecorder(ProfileConfig(path, record_steps=record_steps), torch.device("cpu"))
    step_seconds = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rec:
            with rec.region("prefill"):
                h = torch.randn(8, 64) @ w
            rec.step()
            h = h[-1:]
            for _ in range(decode_steps):
                t0 = time.perf_counter()
                with rec.region("decode_step"):
                    h = torch.tanh(h @ w)
                step_seconds.append(time.perf_counter() - t0)
                rec.step()
    return rec, step_seconds, caught


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def named(events, name, ph="X"):
    return sorted(
        (e for e in events if e.get("name") == name and e.get("ph") == ph and e.get("cat") != "gpu_user_annotation"),
        key=lambda e: e["ts"],
    )


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "sub" / "run.json.gz"  # parent dir does not exist yet
    rec, step_seconds, caught = run_fake_generation(path, decode_steps=20, record_steps=5)
    out = rec.write(STATS, step_seconds)
    return out, step_seconds, caught, rec


def test_written_file_is_gzip_json(recorded):
    path, *_ = recorded
    assert path.name == "run.json.gz" and path.exists()
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    trace = load(path)
    assert isinstance(trace["traceEvents"], list)
    assert not [p for p in path.parent.iterdir() if p.name != "run.json.gz"]  # no temp files left


def test_records_prefill_and_exactly_record_steps_decode_steps(recorded):
    path, *_ = recorded
    events = load(path)["traceEvents"]
    assert len(named(events, "redline.prefill")) == 1
    decode = named(events, "redline.decode_step")
    assert len(decode) == 5
    prefill = named(events, "redline.prefill")[0]
    assert prefill["ts"] < decode[0]["ts"]


def test_no_schedule_warning(recorded):
    *_, caught, _ = recorded
    assert not [w for w in caught if "warmup" in str(w.message).lower()]


def test_counter_track(recorded):
    path, step_seconds, *_ = recorded
    events = load(path)["traceEvents"]
    decode = named(events, "redline.decode_step")
    counters = sorted((e for e in events if e.get("ph") == "C" and e.get("name") == "tokens/sec"), key=lambda e: e["ts"])
    assert len(counters) == 5
    for i, (c, d) in enumerate(zip(counters, decode)):
        assert c["pid"] == d["pid"]
        assert c["ts"] == pytest.approx(d["ts"] + d["dur"])
        assert c["args"]["tokens/sec"] == pytest.approx(1.0 / step_seconds[i])


def test_generate_slice_and_top_level_stats(recorded):
    path, *_ = recorded
    trace = load(path)
    events = trace["traceEvents"]
    (gen,) = named(events, "redline.generate")
    assert gen["cat"] == "user_annotation"
    assert gen["args"] == STATS
    slices = [e for e in events if e.get("ph") == "X" and e.get("cat") != "Trace"]
    assert gen["ts"] == pytest.approx(min(e["ts"] for e in slices))
    assert gen["ts"] + gen["dur"] == pytest.approx(max(e["ts"] + e["dur"] for e in slices), abs=1e-2)
    assert trace["redline"] == {"stats": STATS, "format": 1}


def test_regions_after_the_recorded_window_are_noops(recorded):
    *_, rec = recorded
    assert not rec.recording
    ctx = rec.region("decode_step")
    with ctx:
        pass
    rec.step()  # must not raise or restart recording


def test_short_generation_and_plain_json(tmp_path):
    """Generation shorter than record_steps: __exit__ stops the profiler and exports what ran."""
    path = tmp_path / "short.json"
    rec, step_seconds, _ = run_fake_generation(path, decode_steps=2, record_steps=5)
    out = rec.write({"decode_tok_s": 10.0, "model": torch.float16}, step_seconds)
    trace = json.loads(out.read_text())  # .json -> plain (not gzipped)
    events = trace["traceEvents"]
    assert len(named(events, "redline.decode_step")) == 2
    assert len([e for e in events if e.get("ph") == "C"]) == 2
    assert trace["redline"]["stats"] == {"decode_tok_s": 10.0, "model": "torch.float16"}


def test_write_without_recording_raises(tmp_path):
    rec = TraceRecorder(ProfileConfig(tmp_path / "x.json.gz"), "cpu")
    with pytest.raises(RuntimeError):
        rec.write({}, [])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(path="t.json.gz", record_steps=0),
        dict(path="t.json.gz", record_steps=-3),
        dict(path="t.json.gz", record_steps=2.5),
        dict(path="t.json.gz", record_steps=True),
        dict(path="t.gz"),
        dict(path="t.json.zip"),
        dict(path="trace"),
        dict(path="t.pt.trace"),
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        ProfileConfig(**kwargs)


def test_default_for():
    cfg = ProfileConfig.default_for("meta-llama/Llama 3.2", record_steps=4)
    assert cfg.record_steps == 4
    assert cfg.path.parent == Path("traces")
    assert cfg.path.name.startswith("meta-llama_Llama_3.2-")
    assert cfg.path.name.endswith(".json.gz")
    assert ProfileConfig.default_for("x").record_steps == 16


def test_the_profilers_native_markers_stay_out_of_the_output(tiny_llm_checkpoint, tmp_path):
    """torch's profiler writes `USDT:` / `STAGE:` lines to file descriptor 2 as it starts and stops; on a terminal
    (stdout and stderr one stream) they would land inside the generated text. Other stderr output still gets through."""
    import subprocess
    import sys

    trace = tmp_path / "run.json.gz"
    code = "import sys; from redline.generate import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt",
                           "hello", "--device", "cpu", "--max_new_tokens", "24", "--temperature", "0", "--profile",
                           str(trace)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "USDT:" not in proc.stdout and "STAGE:" not in proc.stdout, proc.stdout
    assert "[sample 1/1] prompt" in proc.stdout and f"trace written to {trace}" in proc.stdout and trace.is_file()


def test_output_written_while_markers_are_dropped_is_kept(capfd):
    import os

    from redline.profiling import native_markers_dropped

    with native_markers_dropped():
        os.write(2, b"USDT:2026 profiler_start\nkeep this\nSTAGE:2026 Completed Stage\n")
    assert capfd.readouterr().err == "keep this\n"
