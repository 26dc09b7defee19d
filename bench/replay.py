"""Time and memory of the trace replay (agent/analysis/replay*.py) on real traces (not a test: run by
hand).

Run: python bench/replay.py TRACE [TRACE ...] [--json]

Each trace is measured in a fresh child process (bench/analysis.py's ``run_child`` and its peak-RSS
report): reading it, building the dependency graph, one replay of it unchanged, and a prediction with
each fix (a copy of the graph and a replay each), the diagnosis and every finding's gain as
``gpuscope explain`` estimates them, with the RSS after reading and the peak (VmHWM) at
exit: what the replay adds to the reading of the trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from analysis import PEAKS, run_child

REPLAY = PEAKS + """\
import json, sys, time
from pathlib import Path
from gpuscope.analysis.replay import replay, step_time
from gpuscope.analysis.diagnose import diagnose
from gpuscope.analysis.gains import estimate_gains
from gpuscope.analysis.replay_fixes import (NotModelled, close_launch_gaps, overlap_communication,
    overlap_untraced_host, predict, prefetch_input, remove_host_syncs, remove_layout_conversions,
    use_tensor_cores)
from gpuscope.analysis.replay_graph import build_graph
from gpuscope.analysis.sources import read_trace

def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

started = time.perf_counter()
trace = read_trace(Path(sys.argv[1]))
read = time.perf_counter()
rss_read = rss()
graph = build_graph(trace)
built = time.perf_counter()
replayed = replay(graph)
measured = sum(s.duration for s in graph.steps.steps) / max(len(graph.steps.steps), 1)
replayed_step = step_time(graph, replayed)
once = time.perf_counter()
fixes = {}
for name, fix in (("host_sync", remove_host_syncs), ("launch_bound", close_launch_gaps),
                  ("input_bound", prefetch_input), ("host_bound", overlap_untraced_host),
                  ("layout_conversion", remove_layout_conversions), ("tensor_cores_idle", use_tensor_cores),
                  ("communication_wait", overlap_communication)):
    t = time.perf_counter()
    try:
        p = predict(graph, [fix])
        after = round(p.after_us / 1e3, 3)
    except NotModelled as err:
        after = f"not modelled: {err}"
    fixes[name] = {"after_ms": after, "seconds": round(time.perf_counter() - t, 3)}
t = time.perf_counter()
diagnosis = diagnose(trace)
diagnosed = time.perf_counter()
gains = estimate_gains(trace, diagnosis.findings)
estimated = time.perf_counter()
findings = {f.kind: gain.text()[:120] for f, gain in gains.each}
print(json.dumps({"events": trace.events_read, "nodes": len(graph), "steps": len(graph.steps.steps),
                  "read_s": round(read - started, 3), "build_s": round(built - read, 3),
                  "replay_s": round(once - built, 3), "rss_after_read": rss_read, "rss_after_replay": rss(),
                  "measured_ms": round(measured / 1e3, 3), "replayed_ms": round(replayed_step / 1e3, 3),
                  "fixes": fixes, "diagnose_s": round(diagnosed - t, 3),
                  "gains_s": round(estimated - diagnosed, 3), "gains": findings}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", type=Path, nargs="+")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    for path in args.traces:
        run = run_child([sys.executable, "-c", REPLAY, str(path)])
        if run.returncode:
            raise SystemExit(f"{path}: the child failed ({run.returncode}):\n{run.stderr}")
        result = json.loads(run.stdout)
        result.update(wall_s=round(run.wall, 3), cpu_s=round(run.cpu, 3), peak_rss=run.rss)
        results[str(path)] = result
    if args.json:
        print(json.dumps(results, indent=2))
        return
    mib = 1 << 20
    for path, r in results.items():
        print(path)
        print(f"  {r['events']} events, {r['nodes']} nodes, {r['steps']} steps; read {r['read_s']} s, "
              f"graph {r['build_s']} s, replay {r['replay_s']} s; RSS {r['rss_after_read'] / mib:.0f} MiB "
              f"after reading, {r['rss_after_replay'] / mib:.0f} MiB after the replay, peak "
              f"{(r['peak_rss'] or 0) / mib:.0f} MiB; step {r['measured_ms']} ms measured, "
              f"{r['replayed_ms']} ms replayed")
        for name, fix in r["fixes"].items():
            after = fix["after_ms"]
            shown = f"{after} ms after" if isinstance(after, float) else after
            print(f"  {name}: {shown}, {fix['seconds']} s")
        print(f"  diagnosis {r['diagnose_s']} s, every finding's gain (estimate_gains) {r['gains_s']} s:")
        for kind, text in r["gains"].items():
            print(f"    {kind}: {text}")


if __name__ == "__main__":
    main()
