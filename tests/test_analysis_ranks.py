"""The ranks of one job explained together, and what `gpuscope explain` says over several traces: a
job's ranks side by side (which rank the others wait for), unrelated traces each with their own
verdict and no overall one, and traces in which nothing could be read."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
from test_analysis_diagnose import KinetoTrace, kernels

from gpuscope.analysis import diagnose as diagnose_module
from gpuscope.analysis.diagnose import Diagnosis
from gpuscope.analysis.findings import UNREADABLE
from gpuscope.analysis.kineto_json import read_kineto
from gpuscope.analysis.ranks import RANK_NAME
from gpuscope.cli.explain import explain_path, explain_paths

STEPS = 8
STEP_US = 33_000.0
TRANSFER_US = 2_000.0
ALL_REDUCE = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)"
SLOW_RANK = 2


def rank_trace(compute_us: float, *, slowest_us: float = 30_000.0) -> KinetoTrace:
    """A data-parallel step: the host launches the compute kernels as they run, then the all-reduce,
    then waits for the stream. The all-reduce cannot end before the slowest rank has joined it, so a
    rank that computes less sits longer in it, and in cudaStreamSynchronize behind it."""
    trace = KinetoTrace()
    for n in range(STEPS):
        start = 1_000_000.0 + n * STEP_US
        trace.host("user_annotation", f"ProfilerStep#{n}", start, STEP_US)
        end = kernels(trace, start, compute_us, each=500.0, gap=0.0)
        done = start + slowest_us + TRANSFER_US
        trace.launch(end - 10.0)
        trace.kernel(ALL_REDUCE, end, done - end)
        trace.host("cuda_runtime", "cudaStreamSynchronize", end, done - end + 5.0)
    return trace


def write(trace: KinetoTrace, path: Path, distributed: dict[str, Any] | None = None) -> Path:
    document: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "H100"}],
                                "traceEvents": trace.events}
    if distributed is not None:
        document["distributedInfo"] = distributed
    path.write_text(json.dumps(document))
    return path


def job(folder: Path, *, info: bool = True, name: str = "worker{rank}.pt.trace.json",
        world_size: int = 4, slow_us: float = 30_000.0) -> Path:
    folder.mkdir()
    for rank in range(4):
        compute = slow_us if rank == SLOW_RANK else 20_000.0
        distributed = {"backend": "nccl", "rank": rank, "world_size": world_size, "pg_count": 1,
                       "nccl_version": "2.21.5"} if info else None
        write(rank_trace(compute, slowest_us=slow_us), folder / name.format(rank=rank), distributed)
    return folder


def explained(paths: Path | list[Path], *, as_json: bool = True) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = explain_paths(paths if isinstance(paths, list) else [paths], as_json=as_json)
    return code, out.getvalue(), err.getvalue()


def report_of(paths: Path | list[Path]) -> dict[str, Any]:
    code, out, err = explained(paths)
    assert code == 0, err
    return dict(json.loads(out))


def test_the_reader_keeps_the_rank_and_world_size(tmp_path: Path) -> None:
    path = write(rank_trace(20_000.0), tmp_path / "a.pt.trace.json",
                 {"backend": "nccl", "rank": 3, "world_size": 8, "pg_config": [{"pg_name": "0"}]})
    assert read_kineto(path).distributed == {"rank": 3, "world_size": 8}
    for bad in ({"rank": 8, "world_size": 8}, {"rank": "3", "world_size": 8}, {"backend": "gloo"}):
        assert read_kineto(write(rank_trace(20_000.0), path, bad)).distributed == {}


def test_the_slowest_rank_and_the_ranks_that_wait_for_it_are_named(tmp_path: Path) -> None:
    report = report_of(job(tmp_path / "job"))
    ranks = report["ranks"]
    assert (ranks["world_size"], ranks["identified_by"], ranks["missing"]) == (4, "distributedInfo", [])
    assert ranks["slowest"] == SLOW_RANK
    assert ranks["waiting"] == [0, 1, 3]
    rows = {row["rank"]: row for row in ranks["per_rank"]}
    slow, fast = rows[SLOW_RANK], rows[0]
    assert slow["compute_ms"] == pytest.approx(30.0, abs=0.2)
    assert fast["compute_ms"] == pytest.approx(20.0, abs=0.2)
    # The fast ranks sit in the all-reduce 12 ms a step, 10 of them waiting for rank 2; so does their
    # host, in cudaStreamSynchronize.
    assert fast["communication_ms"] == pytest.approx(12.0, abs=0.2)
    assert fast["peer_wait_ms"] == pytest.approx(10.0, abs=0.2)
    assert fast["host_blocked_ms"] == pytest.approx(12.0, abs=0.2)
    assert slow["peer_wait_ms"] == 0.0
    assert slow["host_blocked_ms"] == pytest.approx(2.0, abs=0.2)
    assert [row["waits"] for row in ranks["per_rank"]] == [True, True, False, True]
    # The job's verdict is its slowest rank's, and each rank keeps its own.
    verdicts = {Path(source).name: verdict for source, verdict in report["verdicts"].items()}
    assert report["verdict"] == ranks["verdict"] == verdicts["worker2.pt.trace.json"]
    assert verdicts["worker0.pt.trace.json"] == "communication_wait"
    assert len(report["traces"]) == 4

    code, text, _ = explained(tmp_path / "job", as_json=False)
    assert code == 0
    head = text.split("\n\n")[0]
    assert head.startswith("Ranks of one job: 4 traces (world size 4, from distributedInfo)")
    assert f"(that of rank {SLOW_RANK}, the slowest: the others wait for it)" in head
    assert "rank 2 is the slowest" in head and "ranks 0, 1 and 3 wait for it 10.0 ms a step" in head
    (slow_line,) = [line for line in head.splitlines() if "slowest  " in line]
    assert slow_line.split()[:2] == ["2", "33.0"]


def test_ranks_that_keep_pace_wait_for_none(tmp_path: Path) -> None:
    """Rank 2 computes 0.5 ms longer: the others wait for it, but less than the margin."""
    report = report_of(job(tmp_path / "even", slow_us=20_500.0))
    ranks = report["ranks"]
    assert ranks["slowest"] == SLOW_RANK and ranks["waiting"] == []
    assert "no rank waits for it more than 1 ms a step longer than it does" in ranks["summary"]
    code, text, _ = explained(tmp_path / "even", as_json=False)
    assert code == 0 and "(that of rank 2, the slowest)" in text and "  waits  " not in text.split("\n\n")[0]


def test_without_distributed_info_file_names_number_the_ranks(tmp_path: Path) -> None:
    report = report_of(job(tmp_path / "named", info=False, name="train_rank_{rank}.pt.trace.json"))
    ranks = report["ranks"]
    assert (ranks["identified_by"], ranks["world_size"], ranks["slowest"]) == ("file names", None, 2)
    assert ranks["waiting"] == [0, 1, 3]
    assert report["verdict"] == ranks["verdict"]
    # The ranks named one file at a time.
    files = sorted((tmp_path / "named").iterdir())
    assert report_of(files)["ranks"]["slowest"] == 2
    for name, rank in (("rank-3.pt.trace.json", 3), ("job_rank3.1712.pt.trace.json", 3),
                       ("rank_12/host.pt.trace.json", 12)):
        found = RANK_NAME.search(name)
        assert found is not None and int(found.group(1)) == rank
    assert RANK_NAME.search("crank3.pt.trace.json") is None


def test_traces_that_are_not_one_jobs_ranks_have_no_overall_verdict(tmp_path: Path) -> None:
    # Ranks of two jobs (two world sizes), and two unrelated traces with no rank anywhere.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write(rank_trace(20_000.0), mixed / "a.pt.trace.json", {"rank": 0, "world_size": 2})
    write(rank_trace(30_000.0), mixed / "b.pt.trace.json", {"rank": 1, "world_size": 4})
    plain = tmp_path / "plain"
    plain.mkdir()
    write(rank_trace(20_000.0), plain / "train.pt.trace.json")
    write(rank_trace(30_000.0), plain / "eval.pt.trace.json")
    for folder in (mixed, plain):
        report = report_of(folder)
        assert report["verdict"] is None and "ranks" not in report
        assert len(report["verdicts"]) == 2 and all(report["verdicts"].values())
        code, text, _ = explained(folder, as_json=False)
        assert code == 0 and "Ranks of one job" not in text
    # A lone trace keeps its verdict.
    alone = report_of(plain / "train.pt.trace.json")
    assert alone["verdict"] == alone["traces"][0]["verdict"] == "communication_wait"


def test_a_capture_folder_keeps_its_verdict_over_its_traces(tmp_path: Path) -> None:
    folder = job(tmp_path / "capture", info=False, name="node_{rank}.1.pt.trace.json")
    (folder / "capture.json").write_text(json.dumps({"id": "c1", "gpu": None}))
    report = report_of(folder)
    assert report["verdict"] == "communication_wait" and "ranks" not in report


def test_a_trace_with_nothing_in_it_is_unreadable_and_the_command_fails(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pt.trace.json"
    empty.write_text('{"traceEvents": []}')
    for as_json in (True, False):
        code, out, err = explained(empty, as_json=as_json)
        assert code == 1
        assert "healthy" not in out + err
        assert "unreadable: no events" in (err if as_json else out)
    code, out, err = explained(empty)
    report = json.loads(out)
    assert report["verdict"] == UNREADABLE and report["traces"][0]["verdict"] == UNREADABLE
    assert err == f"gpuscope explain: {empty}: unreadable: {report['traces'][0]['unreadable']}\n"


def test_a_folder_with_some_unreadable_traces_lists_them(tmp_path: Path) -> None:
    folder = tmp_path / "some"
    folder.mkdir()
    write(rank_trace(20_000.0), folder / "good.pt.trace.json")
    (folder / "empty.pt.trace.json").write_text('{"traceEvents": []}')
    (folder / "cut.pt.trace.json").write_text('{"traceEvents": [{"ph": "X", ')
    code, text, _ = explained(folder, as_json=False)
    assert code == 0
    assert f"{folder / 'empty.pt.trace.json'}\n  unreadable: no events" in text
    assert f"{folder / 'cut.pt.trace.json'}\n  unreadable: malformed trace JSON" in text
    assert text.rstrip().endswith(f"2 of 3 traces could not be read: {folder / 'cut.pt.trace.json'}, "
                                  f"{folder / 'empty.pt.trace.json'}")
    code, out, err = explained(folder)
    assert code == 0 and err.count("unreadable:") == 2
    report = json.loads(out)
    assert report["verdict"] is None
    assert [report["verdicts"][str(folder / n)] for n in ("cut.pt.trace.json", "empty.pt.trace.json",
                                                          "good.pt.trace.json")] == [
        UNREADABLE, UNREADABLE, "communication_wait"]
    # Nothing readable at all: the command fails, naming each.
    (folder / "good.pt.trace.json").unlink()
    code, out, err = explained(folder)
    assert code == 1 and json.loads(out)["verdict"] == UNREADABLE and err.count("unreadable:") == 2


def unreadable(diagnosis: Diagnosis) -> Diagnosis:
    """The diagnosis as the analysis makes it when nothing could be read: its note says what it lacked."""
    return dataclasses.replace(diagnosis, unreadable=diagnosis.limits[0], findings=())


def test_a_diagnosis_that_found_no_steps_makes_the_trace_unreadable(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = diagnose_module.diagnose
    monkeypatch.setattr(diagnose_module, "diagnose", lambda trace: unreadable(dataclasses.replace(
        real(trace), limits=("The trace holds no step time to analyse.",))))
    path = write(rank_trace(20_000.0), tmp_path / "t.pt.trace.json")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert explain_path(path, as_json=False) == 1
    assert out.getvalue() == f"{path}\n  unreadable: The trace holds no step time to analyse.\n"


def test_the_agent_records_why_a_capture_with_nothing_readable_has_no_verdict(tmp_path: Path) -> None:
    """The capture analysis runs `explain --json` in a child: a failure keeps no verdict, and its last
    line of error, naming what the trace lacked, is the reason."""
    from test_capture_analysis import LIMITS, store_capture

    from gpuscope.capture.analysis_worker import AnalysisWorker
    from gpuscope.capture.store import CaptureStore

    with CaptureStore(tmp_path / "captures", quota_bytes=64 << 20) as store:
        summary = AnalysisWorker(store, LIMITS).analyse(store_capture(store, b'{"traceEvents": []}'))
    assert summary["verdict"] is None
    assert summary["skipped"].endswith(".pt.trace.json: unreadable: no events: the trace holds none that "
                                       "the analysis reads (operators, CUDA runtime calls, kernels, "
                                       "copies, Python functions)")
