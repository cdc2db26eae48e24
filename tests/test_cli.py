import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphstep.cli import main


def test_info(capsys):
    assert main(["info", "--preset", "deepseek-v3.2", "--tp", "8", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "16 / 16 / 16" in out and "index_query" in out and "21.9" in out
    sparse_core = next(line for line in out.splitlines() if line.startswith("sparse_core"))
    assert sparse_core.split()[-1] == "bytes"  # 16 heads: 71 MFLOP a token against 0.5 MB


def test_info_marks_the_compute_bound_sparse_core_at_tp1(capsys):
    assert main(["info", "--tp", "1", "--mla-cache", "fp8", "--batch", "16", "--json"]) == 0
    stages = {c["name"]: c for c in json.loads(capsys.readouterr().out)["floors"][0]["stages"]}
    assert stages["sparse_core"]["mma_us"] == pytest.approx(16 * 2 * 128 * 2048 * 1088 / 800e12 * 1e6)
    assert stages["sparse_core"]["mma_us"] > stages["sparse_core"]["floor_us"]
    assert stages["index_query"]["mma_us"] < stages["index_query"]["floor_us"]


def test_info_rejects_bad_topology(capsys):
    assert main(["info", "--tp", "3"]) == 2
    assert "Topology.tp=3" in capsys.readouterr().err


def test_run_on_cpu_says_what_it_did(capsys):
    assert main(["run", "--cpu", "--cpu-batch", "2", "--cpu-context", "300"]) == 0
    out = capsys.readouterr().out
    assert "reference step on the CPU" in out and "need an sm_90 GPU" in out
    assert out.count("\n") >= 5


def test_console_script_installed():
    exe = Path(sys.executable).parent / "graphstep"
    if not exe.exists():
        pytest.skip("graphstep is not installed as a console script here")
    result = subprocess.run([str(exe), "info", "--batch", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "indexer floor" in result.stdout


def test_gpu_commands_say_they_need_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for command in (["serve"], ["bench"], ["tune"], ["graph", "--batch", "4"]):
        with pytest.raises(SystemExit, match="needs an sm_90 GPU"):
            main(command)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["info", "--bandwidth", "0"], "--bandwidth: expected a positive number, got '0'"),
        (["info", "--bandwidth", "-1"], "--bandwidth: expected a positive number"),
        (["info", "--context", "0"], "--context: expected a positive integer"),
        (["ptx", "--arch", "foo"], "invalid choice: 'foo'"),
        (["ptx", "--batch-size", "0"], "--batch-size: expected a positive integer"),
        (["graph", "--mode", "bogus"], "invalid choice: 'bogus'"),
        (["serve", "--steps", "-3"], "--steps: expected a positive integer"),
        (["run", "--cpu-batch", "x"], "--cpu-batch: expected a positive integer"),
        (["bench", "--dcp", "2,x"], "--dcp: expected comma-separated DCP sizes"),
        (["bench", "--dcp", "0"], "--dcp: DCP sizes must be positive"),
        (["run", "--cpu", "--seed", "-1"], "--seed: expected a seed in [0, 2^63), got '-1'"),
        (["serve", "--seed", str(2**63)], "--seed: expected a seed in [0, 2^63)"),  # past torch's int64
        (["bench", "--seed", "1.5"], "--seed: expected a seed in [0, 2^63)"),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def _error(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def test_output_folders_are_checked_before_any_work(tmp_path, capsys):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    assert "--out" in _error(["ptx", "--out", str(afile)], capsys)
    assert "not a writable folder" in _error(["ptx", "--out", str(afile / "below")], capsys)
    assert "exists and is not a folder" in _error(["bench", "--out", str(afile)], capsys)  # before "needs a GPU"


def test_a_context_that_does_not_fit_says_how_much_it_needs(capsys):
    err = _error(["run", "--cpu", "--cpu-batch", "10000", "--cpu-context", "163840"], capsys)
    assert "--cpu-batch 10000 --cpu-context 163840: the state for batch 10000 needs about" in err
    assert "GB of memory available" in err
    # the batch is the flag to lower here: named, with the context it was not given (before: "--cpu-context 4096")
    err = _error(["run", "--cpu", "--cpu-batch", "100000"], capsys)
    assert "--cpu-batch 100000 --cpu-context 4096: the state" in err


def test_the_gpu_memory_check_names_the_batch_and_context_flags(monkeypatch):
    """The GPU verbs' check names --batch (or --batch-size) and --context, not --context alone."""
    import torch

    from graphstep.cli import _check_device_memory
    from graphstep.shapes import RankShape, Topology, preset

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1, 1))
    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    with pytest.raises(ValueError, match=r"^--batch 1,4 --context 4096: the state for batch 4 needs about"):
        _check_device_memory(argparse.Namespace(batch=[1, 4], context=4096), shape, 4)
    with pytest.raises(ValueError, match=r"^--batch-size 2 --context 4096: the 4 states for batch 2 need"):
        _check_device_memory(argparse.Namespace(batch_size=2, context=4096), shape, 2, states=4)


def test_the_cpu_dcp_groups_memory_check_counts_the_unsharded_layer_and_every_rank(monkeypatch, capsys):
    """run --dcp d on the CPU builds the unsharded layer and d ranks (each stepping at once), not
    one rank's state: memory for one rank's state is refused (before: the group was built)."""
    from dataclasses import replace

    from graphstep.cli import group_bytes
    from graphstep.shapes import RankShape, Topology, preset
    from graphstep.state import state_bytes

    rank = RankShape(preset("deepseek-v3.2"), Topology(tp=8, dcp=4))
    unsharded = RankShape(rank.model, replace(rank.topology, tp=2, dcp=1))
    kept = state_bytes(unsharded, 1, 4096, building=False)
    kept += sum(state_bytes(rank.with_topology(rank=r), 1, 4096, building=False) for r in range(4))
    working = state_bytes(rank, 1, 4096, reference=True) - state_bytes(rank, 1, 4096)
    assert group_bytes(rank, 1, 4096) >= kept + 4 * working
    assert group_bytes(rank, 1, 4096) >= state_bytes(unsharded, 1, 4096)  # the unsharded layer's build
    monkeypatch.setattr("graphstep.cli.host_memory_bytes", lambda: state_bytes(rank, 1, 4096, reference=True) + 1)
    err = _error(["run", "--cpu", "--dcp", "4", "--cpu-batch", "1", "--cpu-context", "4096"], capsys)
    assert "--cpu-batch 1 --cpu-context 4096: the DCP group of 4 ranks for batch 1 needs about" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--cpu", "--cpu-context", "163841"],
        ["info", "--context", "200000"],
        ["bench", "--context", "163841"],  # before "needs a GPU"
        ["info", "--preset", "kimi-k3.1", "--context", "262145"],
    ],
)
def test_a_context_past_the_models_max_seq_len_is_refused(argv, capsys):
    err = _error(argv, capsys)
    value = argv[-1]
    limit = "262144" if "kimi-k3.1" in argv else "163840"
    assert f"context {value}: more than" in err and f"'s {limit} tokens (ModelShape.max_seq_len" in err


def test_the_models_max_seq_len_itself_is_accepted(capsys):
    assert main(["info", "--preset", "kimi-k3.1", "--context", "262144", "--batch", "1"]) == 0


def test_the_memory_check_counts_every_state_a_command_keeps():
    """bench keeps four steps at once: one state's build (its fp32 draws) and three built ones."""
    from graphstep.cli import STATES, check_fits
    from graphstep.shapes import RankShape, Topology, preset
    from graphstep.state import state_bytes

    shape = RankShape(preset("deepseek-v3.2"), Topology(tp=8))
    one, built = state_bytes(shape, 64, 32768), state_bytes(shape, 64, 32768, building=False)
    assert 0 < built < one
    assert STATES["bench"] == 4
    flags = "--batch 64 --context 32768"
    check_fits(shape, 64, 32768, one + 3 * built, "free GPU memory", flags, states=4)  # fits exactly
    with pytest.raises(ValueError, match=rf"{flags}: the 4 states for batch 64 need about .* free GPU memory"):
        check_fits(shape, 64, 32768, one + 3 * built - 1, "free GPU memory", flags, states=4)


def test_cpu_run_rejects_the_gpu_runs_flags(capsys):
    for flag, value in (
        ("--batch", "4"),
        ("--context", "100"),
        ("--policy", "fork"),
        ("--replays", "3"),
        ("--bandwidth", "3.35"),
    ):
        err = _error(["run", "--cpu", flag, value], capsys)
        assert f"{flag}: for the GPU run only" in err and "--cpu-batch" in err


def test_cpu_run_honours_its_flags(capsys):
    assert main(["run", "--cpu", "--cpu-batch", "3", "--cpu-context", "100", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(lines) == 3 + 1 and all(int(line.split()[1]) <= 100 for line in lines[:3])  # 3 tokens + the summary


def test_run_of_a_dcp_group_takes_no_rank(capsys):
    assert "--rank 1: run --dcp 2 runs the whole group" in _error(
        ["run", "--cpu", "--dcp", "2", "--tp", "8", "--rank", "1"], capsys
    )


def test_policy_and_trace_are_checked_before_the_gpu(tmp_path, capsys):
    assert "'1:bogus'" in _error(["serve", "--policy", "1:bogus"], capsys)
    assert "'1:bogus'" in _error(["run", "--policy", "1:bogus"], capsys)
    assert "No such file" in _error(["serve", "--trace", str(tmp_path / "missing")], capsys)
    trace = tmp_path / "trace"
    trace.write_text("1 2 64")
    assert "needs batch 64 but the largest captured size (--batch) is 32" in _error(
        ["serve", "--trace", str(trace)], capsys
    )
    assert "fork_poll" in _error(["graph", "--tp", "1", "--wide", "--mode", "fork_poll"], capsys)


def test_a_bad_watchdog_is_an_error_not_a_traceback(monkeypatch, capsys):
    for value in ("abc", "0", "-1", "nan"):
        monkeypatch.setenv("GRAPHSTEP_WATCHDOG", value)
        assert "GRAPHSTEP_WATCHDOG" in _error(["info", "--batch", "1"], capsys)


def test_the_watchdog_works_under_a_captured_stderr_and_is_disarmed_on_return(monkeypatch, capsys):
    """main() in a process that goes on (pytest's capture, a notebook: sys.stderr without a
    file descriptor): the watchdog writes to the real stderr and is cancelled when main returns
    (before: "graphstep info: fileno", and an armed timer that would later kill the process)."""
    import faulthandler

    calls = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda s, exit, file: calls.append((s, file.fileno())))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: calls.append("cancel"))
    monkeypatch.setenv("GRAPHSTEP_WATCHDOG", "100")
    assert main(["info", "--batch", "1"]) == 0, capsys.readouterr().err
    assert calls == [(100.0, sys.__stderr__.fileno()), "cancel"]
    calls.clear()
    monkeypatch.setattr("graphstep.cli.sm90_device", lambda: False)
    with pytest.raises(SystemExit, match="needs an sm_90 GPU"):  # a subcommand's exit disarms it too
        main(["serve"])
    assert calls == [(100.0, sys.__stderr__.fileno()), "cancel"]
    monkeypatch.delenv("GRAPHSTEP_WATCHDOG")
    calls.clear()
    assert main(["info", "--batch", "1"]) == 0 and calls == []  # unset: neither armed nor cancelled


def test_help_shows_defaults(capsys):
    for verb, shown in (
        ("info", "(default: 4.3)"),
        ("run", "(default: 1,4,16,64)"),
        ("ptx", "(default: sm_90a)"),
        ("serve", "(default: 1000)"),
        ("bench", "(default: bench-out)"),
        ("graph", "(default: fork)"),
    ):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert shown in out and "(default: deepseek-v3.2)" in out, verb


def test_a_closed_pipe_is_not_a_traceback():
    exe = Path(sys.executable).parent / "graphstep"
    if not exe.exists():
        pytest.skip("graphstep is not installed as a console script here")
    result = subprocess.run(f"'{exe}' info | head -2", shell=True, capture_output=True, text=True, timeout=120)
    assert result.stdout.count("\n") == 2 and result.stderr == ""


def test_info_json(capsys):
    assert main(["info", "--batch", "1,16", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["topology"] == "tp8" and record["sizes"]["heads"] == 16
    assert [f["batch"] for f in record["floors"]] == [1, 16]
    assert record["floors"][1]["indexer_floor_us"] == pytest.approx(21.9, abs=0.05)
    assert "index_query" in [stage["name"] for stage in record["floors"][0]["stages"]]


def test_cpu_run_json(capsys):
    assert main(["run", "--cpu", "--cpu-batch", "2", "--cpu-context", "300", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["device"] == "cpu" and record["graphs"] is False
    assert [t["token"] for t in record["tokens"]] == [0, 1] and all(t["context"] <= 300 for t in record["tokens"])


def test_json_flags_are_offered(capsys):
    for verb in ("info", "run", "serve", "trace"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        assert "--json" in capsys.readouterr().out, verb


def test_trace_checks_its_flags_then_needs_a_gpu(tmp_path, capsys):
    import torch

    assert "is a folder" in _error(["trace", "--out", str(tmp_path)], capsys)
    assert "fork_poll" in _error(["trace", "--tp", "1", "--wide", "--mode", "fork_poll"], capsys)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="graphstep trace: needs an sm_90 GPU"):
        main(["trace", "--out", str(tmp_path / "t.json")])


def test_ptx_prints_each_file_as_it_is_written(tmp_path, monkeypatch, capsys):
    from graphstep.kernels import catalog

    printed = []

    def write_ptx(out_dir, arch, shape, batch=None, tiled=None, written_one=None, sass=False):
        paths = []
        for name in ("a.ptx", "b.ptx"):
            path = tmp_path / name
            path.write_text("ptx")
            written_one(path)
            printed.append(capsys.readouterr().out)  # what the command had printed by then
            paths.append(path)
        return paths

    monkeypatch.setattr(catalog, "write_ptx", write_ptx)
    assert main(["ptx", "--out", str(tmp_path)]) == 0
    assert printed == [f"{tmp_path / 'a.ptx'}\n", f"{tmp_path / 'b.ptx'}\n"]
    assert "2 kernel variants" in capsys.readouterr().out


def test_ptx_sass_passes_the_flag_and_counts_variants_not_files(tmp_path, monkeypatch, capsys):
    from graphstep.kernels import catalog

    asked = []

    def write_ptx(out_dir, arch, shape, batch=None, tiled=None, written_one=None, sass=False):
        asked.append(sass)
        return [tmp_path / "a.sm_90a.ptx", tmp_path / "a.sm_90a.sass"]

    monkeypatch.setattr(catalog, "write_ptx", write_ptx)
    assert main(["ptx", "--out", str(tmp_path), "--sass"]) == 0
    assert asked == [True]
    assert "1 kernel variants" in capsys.readouterr().out


def test_graph_table_names_each_kernel_by_its_stage():
    from graphstep.cli import describe_graph
    from graphstep.graphs import PROGRAMMATIC, Edge, GraphInfo, Node

    project = "kernel_cutlass_project_graphstepkernelsmla_queryMlaQuery_object_at__ptrbf16gmemalign16_1"
    info = GraphInfo(
        [
            Node(0, "kernel", project),
            Node(1, "kernel", "_ZN2at6native29vectorized_elementwise_kernel"),
            Node(2, "memcpy", ""),
        ],
        [Edge(0, 1, PROGRAMMATIC, 0), Edge(1, 2, 0, 0)],
    )
    text = describe_graph(info)
    rows = [line.split() for line in text.splitlines()[2:5]]
    assert rows == [
        ["0", "kernel", "MlaQuery", "MlaQuery.project"],
        ["1", "kernel", "torch", "_ZN2at6native29vectorized_elementwise_kernel"],  # not a CuTe kernel: as named
        ["2", "memcpy"],
    ]
    assert "3 nodes (2 kernels), 2 edges, 1 programmatic" in text


def test_cpu_run_dcp_runs_the_group(capsys):
    assert main(["run", "--cpu", "--dcp", "2", "--cpu-batch", "2", "--cpu-context", "300", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["topology"] == "tp8-dcp2" and [r["rank"] for r in record["ranks"]] == [0, 1]
    # each rank picks the selected positions it holds: together every position of both tokens (< top-k)
    assert sum(r["slots_picked"] for r in record["ranks"]) == sum(t["context"] for t in record["tokens"])
    assert record["group_seconds"] > 0 and all(r["seconds"] > 0 for r in record["ranks"])


def test_bench_checks_every_dcp_size_and_the_group_flag_before_the_gpu(capsys):
    assert "--dcp 3: --tp 8 must be a multiple of it" in _error(["bench", "--tp", "8", "--dcp", "2,3"], capsys)
    assert "--dcp 3: --tp 8 must be a multiple of it" in _error(["run", "--cpu", "--tp", "8", "--dcp", "3"], capsys)
    assert "--group-only: needs --dcp sizes above 1" in _error(["bench", "--group-only"], capsys)


@pytest.mark.parametrize(
    "knob, error",
    [
        ("mla_query.STREAM_FROM_HEADS", "expected KERNEL.NAME=VALUE"),
        ("STREAM_FROM_HEADS=4", "expected KERNEL.NAME=VALUE"),
        ("mla_querry.STREAM_FROM_HEADS=4", "no kernel 'mla_querry'"),
        ("mla_query.stream_tokens=4", "'stream_tokens' is not a knob of kernels/mla_query.py (its knobs: "),
        ("mla_query.SUPPORTED={}", "'SUPPORTED' is not a knob"),
        ("sparse_core.PROBE='no_math'", "'PROBE' is not a knob"),  # a probe: wrong results
        ("sparse_core.COLS=4", "'COLS' is not a knob"),  # a layout fact other modules hold too
        ("top_k.PICKS=()", "is not a knob of kernels/top_k.py (it has none)"),
        ("mla_query.STREAM_FROM_HEADS=sixty", "'sixty' is not a Python literal"),
        ("sparse_core.CLUSTER_SPLITS=True", "sparse_core.CLUSTER_SPLITS takes an int (now 2)"),
        ("sparse_core.RESHAPE_BLOCKS=None", "sparse_core.RESHAPE_BLOCKS takes an int"),
        ("mla_query.STREAM_FROM_HEADS=2.0", "mla_query.STREAM_FROM_HEADS takes an int or None (now 128)"),
        ("sparse_core.CROSSOVER=True", "sparse_core.CROSSOVER takes a dict"),
        ("sparse_core.CROSSOVER={'fp8': False}", "takes the keys ['bf16', 'fp8']"),
        (
            "sparse_core.FP8_ROW_LOADS={'transposed': '16B', 'wgmma': '8B', 'wgmm': '16B'}",
            "takes the keys ['transposed', 'wgmma']",
        ),
        ("sparse_core.CROSSOVER={'fp8': 'no', 'bf16': True}", "sparse_core.CROSSOVER['fp8'] takes a bool (now True)"),
        ("sparse_core.MMA_BULK_SIXTEENTHS={'fp8': 9, 'bf16': 10.5}", "MMA_BULK_SIXTEENTHS['bf16'] takes an int"),
        ("sparse_core.MMA_PRODUCER_BLOCKS={'fp8': None, 'bf16': 1}", "MMA_PRODUCER_BLOCKS['fp8'] takes an int"),
    ],
)
def test_knob_errors_name_what_is_wrong(capsys, monkeypatch, knob, error):
    """--knob is checked with the other flags: a bad one exits 2 with its reason, touching nothing."""
    from graphstep.kernels import mla_query, sparse_core

    for module, name in ((mla_query, "STREAM_FROM_HEADS"), (sparse_core, "CLUSTER_SPLITS"), (sparse_core, "CROSSOVER")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored whatever this test does
    before = (mla_query.STREAM_FROM_HEADS, sparse_core.CLUSTER_SPLITS, sparse_core.PROBE, dict(sparse_core.CROSSOVER))
    assert main(["info", "--knob", "mla_query.STREAM_FROM_HEADS=64", "--knob", knob]) == 2
    assert error in capsys.readouterr().err
    assert (mla_query.STREAM_FROM_HEADS, sparse_core.CLUSTER_SPLITS, sparse_core.PROBE, sparse_core.CROSSOVER) == before


def test_knob_sets_the_constant_the_variants_follow(tmp_path, monkeypatch, capsys):
    """`graphstep ptx --knob mla_query.STREAM_FROM_HEADS=1` writes MlaQuery's streamed variant
    in place of the register kernel (the knobs apply before the command runs)."""
    from graphstep.kernels import mla_query, sparse_core

    from graphstep.cli import apply_knobs

    monkeypatch.setattr(mla_query, "STREAM_FROM_HEADS", None)  # restored after the test
    monkeypatch.setattr(sparse_core, "CROSSOVER", dict(sparse_core.CROSSOVER))
    assert apply_knobs(["sparse_core.CROSSOVER={'fp8': True, 'bf16': False}"]) == {
        "sparse_core.CROSSOVER": {"fp8": True, "bf16": False}
    }
    assert sparse_core.CROSSOVER == {"fp8": True, "bf16": False}
    out = tmp_path / "ptx"
    args = ["ptx", "--tp", "1", "--batch-size", "4", "--out", str(out), "--knob", "mla_query.STREAM_FROM_HEADS=1"]
    assert main(args) == 0
    assert mla_query.STREAM_FROM_HEADS == 1
    names = {p.name.split(".")[0] for p in out.iterdir()}
    assert "mla_query_rows_s16" in names and "mla_query_rows" not in names


def test_every_knob_is_a_constant_of_a_type_it_takes():
    """Each kernel module's KNOBS names constants it has, of a type the entry lists (what
    --knob checks a new value against)."""
    from graphstep.kernels import catalog

    declared = {name: module.KNOBS for name, module in catalog.KERNELS.items() if hasattr(module, "KNOBS")}
    assert {"sparse_core", "mla_query"} <= set(declared)
    for name, knobs in declared.items():
        for constant, kinds in knobs.items():
            kinds = kinds if isinstance(kinds, tuple) else (kinds,)
            assert type(getattr(catalog.KERNELS[name], constant)) in kinds, (name, constant)


def test_knobs_lists_every_knob_with_this_runs_value(capsys, monkeypatch):
    from graphstep.kernels import catalog, sparse_core

    monkeypatch.setattr(sparse_core, "CLUSTER_SPLITS", sparse_core.CLUSTER_SPLITS)  # restored after the test
    assert main(["knobs", "--knob", "sparse_core.CLUSTER_SPLITS=4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    declared = [(k, n) for k, m in catalog.KERNELS.items() for n in getattr(m, "KNOBS", {})]
    assert len(lines) == 2 + len(declared) + 1  # header, rule, a row each, the hint
    row = next(line.split() for line in lines if "CLUSTER_SPLITS" in line)
    assert row[:3] == ["sparse_core", "CLUSTER_SPLITS", "4"] and row[-1] == "--knob"
    assert sparse_core.CLUSTER_SPLITS == 4


def test_every_knob_given_as_its_repr_is_recorded_as_json(monkeypatch):
    """A run's --knob records go into its JSON (graphstep bench's bench.json, --json): every
    knob, given as the repr of its value, parses and is written, a tuple key (as
    PLAN_HALF_WAVE_TOKENS') as its repr, which reads back as the tuple."""
    import ast

    from graphstep.kernels import catalog, sparse_core

    from graphstep.cli import apply_knobs
    from graphstep.report import json_keys

    texts = []
    for kernel, module in catalog.KERNELS.items():
        for constant in getattr(module, "KNOBS", {}):
            monkeypatch.setattr(module, constant, getattr(module, constant))  # restored after the test
            texts.append(f"{kernel}.{constant}={getattr(module, constant)!r}")
    records = json.loads(json.dumps(json_keys(apply_knobs(texts))))
    assert len(records) == len(texts)
    half = records["sparse_core.PLAN_HALF_WAVE_TOKENS"]
    assert {ast.literal_eval(key): value for key, value in half.items()} == sparse_core.PLAN_HALF_WAVE_TOKENS


def test_the_cpu_run_refuses_knobs_as_the_gpu_runs_flag_they_are(monkeypatch, capsys):
    """--knob sets GPU kernels' constants: the CPU run refuses it as it does --batch (before: ignored)."""
    from graphstep.kernels import mla_query

    monkeypatch.setattr(mla_query, "TARGET_CTAS", mla_query.TARGET_CTAS)  # restored after the test
    monkeypatch.setattr("graphstep.cli.sm90_device", lambda: False)
    err = _error(["run", "--cpu-batch", "1", "--cpu-context", "64", "--knob", "mla_query.TARGET_CTAS=5"], capsys)
    assert "--knob: for the GPU run only (no sm_90 GPU was found); the CPU reference run takes --cpu-batch" in err


def test_output_folders_are_made_only_when_written(tmp_path, monkeypatch, capsys):
    """A refused run (here: no GPU) leaves no folder behind; a folder below a file is still refused."""
    monkeypatch.setattr("graphstep.cli.sm90_device", lambda: False)
    monkeypatch.chdir(tmp_path)
    for argv in (["trace", "--out", str(tmp_path / "new" / "dir" / "x.json")], ["bench", "--out", "b/c"], ["bench"]):
        with pytest.raises(SystemExit, match="needs an sm_90 GPU"):
            main(argv)
    assert list(tmp_path.iterdir()) == []  # no new/dir, b/c or bench-out
    (tmp_path / "a-file").write_text("x")
    assert "--out a-file/b/c: not a writable folder" in _error(["ptx", "--out", "a-file/b/c"], capsys)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")  # mkdir would raise FileExistsError after the work
    assert "--out dangling: not a writable folder" in _error(["ptx", "--out", "dangling"], capsys)


@pytest.mark.parametrize("verb", ["info", "serve", "tune", "trace", "graph", "ptx", "bench", "run"])
@pytest.mark.parametrize("topology", [["--dcp", "1000000"], ["--tp", "64", "--dcp", "64"]])
def test_every_command_refuses_more_dcp_ranks_than_a_group_can_have(verb, topology, tmp_path, capsys):
    """The 32-rank bound (CandidateSync's lanes) applies to every command, at argument time
    (before: info, serve, tune, trace, graph and ptx took any)."""
    from graphstep.cli import MAX_DCP
    from graphstep.dcp_group import FLAG_WORDS

    assert MAX_DCP == FLAG_WORDS
    out = ["--out", str(tmp_path / "out")] if verb in ("ptx", "bench") else []
    assert f"--dcp {topology[-1]}: more than 32 ranks" in _error([verb, *topology, *out], capsys)


def test_only_the_commands_that_build_a_group_need_dcp_to_divide_tp(capsys):
    """run and bench build a DCP group (its unsharded layer has tp / dcp); info and ptx simulate
    one rank, which Topology allows at any tp (tests/test_ops.py uses tp 2, dcp 4)."""
    for verb in ("run", "bench"):
        assert "--dcp 3: --tp 8 must be a multiple of it" in _error([verb, "--tp", "8", "--dcp", "3"], capsys)
    assert main(["info", "--tp", "1", "--dcp", "2"]) == 0
    capsys.readouterr()


def test_policy_errors_name_the_flag(capsys):
    """An entry of a mode the topology does not allow, even at a size not captured, a table naming
    no captured size, and '' are refused naming --policy (before: all three were accepted)."""
    err = _error(["serve", "--tp", "1", "--wide", "--policy", "3:fork_poll"], capsys)
    assert "--policy '3:fork_poll': " in err and "'fork_poll'" in err
    err = _error(["serve", "--policy", "64:serial"], capsys)
    assert (
        "--policy '64:serial': " in err and "no entry names a captured size (captured: [1, 2, 4, 8, 16, 24, 32]" in err
    )
    assert "--policy '': " in _error(["serve", "--policy", ""], capsys)


def test_run_with_dcp_refuses_a_policy_its_group_would_ignore(capsys):
    err = _error(["run", "--dcp", "2", "--policy", "serial"], capsys)
    assert "--policy 'serial': run --dcp 2 times a group of real ranks, which runs its own fixed policy" in err


def test_a_policy_entry_naming_no_captured_size_is_noted_not_refused(capsys, monkeypatch):
    """tune's table names sizes serve need not capture: those entries are said once on stderr and
    unused; the command goes on (here to its GPU check, made to find none)."""
    monkeypatch.setattr("graphstep.cli.sm90_device", lambda: None)
    with pytest.raises(SystemExit, match="needs an sm_90 GPU"):  # past every flag check
        main(["serve", "--policy", "1:serial,64:fork"])
    err = capsys.readouterr().err
    assert "note: --policy '1:serial,64:fork': overlap policy entries 64:fork name no captured size" in err
    assert err.count("note:") == 1
    assert main(["run", "--policy", "1:serial,2:fork"]) == 2  # (no GPU: the CPU run refuses --policy)
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "--policy: for the GPU run only" in err
    from graphstep.policy import modes_for

    with pytest.warns(UserWarning, match="entries 2:fork name no captured size"):  # no filter left behind
        modes_for([1, 4], "1:serial,2:fork")
    assert "--policy '1:bogus': " in _error(["run", "--policy", "1:bogus"], capsys)


@pytest.mark.parametrize("kind", ["missing", "folder", "binary", "empty path"])
def test_a_bad_trace_file_names_the_flag_and_the_path(kind, tmp_path, capsys):
    """Before: a raw errno, a codec error, or for '' the synthetic trace."""
    path = {"missing": str(tmp_path / "nope"), "folder": str(tmp_path), "binary": str(tmp_path / "b"), "empty path": ""}
    (tmp_path / "b").write_bytes(b"\x7fELF\xd0\xff\x00\x01")
    expected = {
        "missing": f"--trace {path['missing']}: cannot read it (No such file or directory)",
        "folder": f"--trace {tmp_path}: cannot read it (Is a directory)",
        "binary": f"--trace {path['binary']}: not a text file",
        "empty path": "--trace '': expected the path of a file of batch sizes",
    }
    assert expected[kind] in _error(["serve", "--trace", path[kind]], capsys)


def test_knob_parts_are_stripped_and_a_str_value_says_how_to_quote(monkeypatch):
    from graphstep.kernels import sparse_core

    from graphstep.cli import parse_knob

    assert parse_knob(" mla_query . TARGET_CTAS = 5 ") == ("mla_query", "TARGET_CTAS", 5)
    with pytest.raises(ValueError) as error:
        parse_knob("sparse_core.FP8_ROW_LOADS={transposed: 16B, wgmma: 8B}")
    quoted = f'--knob "sparse_core.FP8_ROW_LOADS={sparse_core.FP8_ROW_LOADS!r}"'
    assert "is not a Python literal; quote a str" in str(error.value) and quoted in str(error.value)
    with pytest.raises(ValueError) as error:
        parse_knob("mla_query.TARGET_CTAS=five")  # an int knob: no quoting hint
    assert str(error.value).endswith("'five' is not a Python literal")


def test_help_prints_no_empty_default(capsys):
    """--knob's default is [] (before: "(repeatable) (default: )" in every subcommand's --help)."""
    for verb in ("info", "knobs", "run", "ptx", "serve", "bench", "tune", "trace", "graph"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "(repeatable)" in out and "(default: )" not in out, verb


def test_tables_print_extreme_values_readably(capsys):
    """Fixed-point above 1e9 would be hundreds of digits (info --bandwidth 1e-300); ordinary
    values print as before."""
    from graphstep.report import table

    assert table(["a", "b", "c", "d"], [[1e-300, 2.4e300, 123.456, 0.01234]]).splitlines()[2].split() == [
        "1e-300",
        "2.4e+300",
        "123.5",
        "0.0123",
    ]
    assert main(["info", "--batch", "1", "--bandwidth", "1e-300"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) < 200
