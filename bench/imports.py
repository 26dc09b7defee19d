"""Where the agent's memory goes before it reads a GPU: RSS by what it imports (not a test).

    python bench/imports.py [--runs 3]

Each row is a fresh interpreter that imports everything of the rows above it and its own, in the
order the agent loads them, and reports its RSS (VmRSS, median of ``--runs``); the difference to
the row above is what that row adds. "The standard library the agent uses" is found, not listed:
the standard-library modules that ``gpuscope run``'s imports load. The last rows are loaded only
when used (gRPC when a capture, the kubelet or the control API needs it; prometheus_client when a
scrape asks for what only its encoders write; the trace analysis in its own child process). Every
row but the first imports hashlib as the command line does, without OpenSSL's libcrypto
(``gpuscope.common.builtin_hashes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig

# The agent's process: the command line and the agent (gRPC and the analysis stay out of it).
AGENT = ["gpuscope.cli.main", "gpuscope.agent"]
STEPS: list[tuple[str, list[str]]] = [
    ("Python itself", []),
    ("the standard library the agent uses", []),  # filled in by stdlib_modules()
    ("PyYAML", ["yaml"]),
    ("pydantic", ["pydantic", "pydantic.fields", "pydantic.main"]),
    ("the configuration models", ["gpuscope.config"]),
    ("psutil, nvidia-ml-py", ["psutil", "pynvml"]),
    ("the rest of the agent (what `gpuscope run` loads)", AGENT),
    ("gRPC, protobuf and the generated stubs (in the agent only for the kubelet; else in the control "
     "API's server process and the profiler client processes)",
     ["grpc", "google.protobuf", "gpuscope.generated.tsl.profiler_service_pb2_grpc",
      "gpuscope.generated.kubelet.v1.podresources_pb2_grpc", "gpuscope.capture.tsl_client",
      "gpuscope.host.kubelet"]),
    ("the control server (only in its server process)", ["gpuscope.control.server"]),
    ("prometheus_client, with its HTTP client and server and ssl (only for a family or an escaping "
     "scheme the agent's encoders leave to it)", ["prometheus_client"]),
    ("the trace analysis (only in its child process)", ["gpuscope.analysis.diagnose"]),
]
_BUILTIN_HASHES = ("from gpuscope.common.builtin_hashes import prefer_builtin_hashes\n"
                   "prefer_builtin_hashes()\n")
_RSS = "import re; print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"


def stdlib_modules() -> list[str]:
    """The standard-library modules (with a file; not private ones) that importing the agent loads."""
    script = (f"import json, sys, sysconfig\nimport {', '.join(AGENT)}\n"
              "std = sysconfig.get_paths()['stdlib']\n"
              "files = {n: getattr(m, '__file__', None) or '' for n, m in list(sys.modules.items())}\n"
              "print(json.dumps(sorted(n for n, f in files.items()\n"
              "                        if f.startswith(std) and '-packages' not in f)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    names: list[str] = json.loads(out)
    return [name for name in names if not any(part.startswith("_") for part in name.split("."))]


def rss_kib(modules: list[str], runs: int) -> float:
    # As `gpuscope` does before its own imports: hashlib without OpenSSL (gpuscope.common.builtin_hashes).
    prelude = _BUILTIN_HASHES if modules else ""
    script = prelude + "".join(f"import {m}\n" for m in modules) + _RSS
    return statistics.median(
        int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
        for _ in range(runs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="interpreters per row (default 3)")
    args = parser.parse_args()
    steps = list(STEPS)
    steps[1] = (steps[1][0], stdlib_modules())
    print(f"Python {sys.version.split()[0]}, {sysconfig.get_platform()}; RSS of a fresh interpreter, "
          f"median of {args.runs}\n")
    print("| loaded | RSS | + |\n|---|---|---|")
    loaded: list[str] = []
    previous = None
    for label, modules in steps:
        loaded += modules
        rss = rss_kib(loaded, args.runs) / 1024
        added = "" if previous is None else f"+{rss - previous:.1f}"
        print(f"| {label} | {rss:.1f} MiB | {added} |")
        previous = rss
    print(f"\nthe standard library the agent uses ({len(steps[1][1])} modules): {', '.join(steps[1][1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
