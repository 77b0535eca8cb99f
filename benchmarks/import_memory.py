"""Peak memory and speed of ``opengem import`` on a generated events-table log, at several sizes.

    python benchmarks/import_memory.py --rows 10000 100000 --users-per-row 0.1 --events 3000

Each size: the log is written (impressions + an events table of ``events`` events per user,
shuffled) to a temporary directory, then imported in a fresh process whose peak RSS (``ru_maxrss``)
is read back. One JSON line per size: rows, users, events, seconds, events/s, peak RSS in MiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, json
from opengem.data.sources import convert
from opengem.data.sources.fake_log import spec
m = convert("generic", sys.argv[1], sys.argv[2], spec=spec(max_len=int(sys.argv[3])))
print(json.dumps({"buckets": m.source["storage"]["buckets"], "layout": m.layout}))
"""


def measure(rows: int, users: int, events: int, max_len: int, work: Path) -> dict:
    from opengem.data.sources.fake_log import write_log

    log = write_log(work / f"log-{rows}", rows=rows, users=users, events_per_user=events)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(log), str(work / f"out-{rows}"),
                          str(max_len)],
                         check=True, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    # the largest child so far (KiB → MiB)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"rows": rows, "users": users, "events": users * events, "seconds": round(secs, 1),
            "events_per_s": round(users * events / secs), "rows_per_s": round(rows / secs),
            "peak_rss_mib": round(peak), **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--users-per-row", type=float, default=0.1)
    p.add_argument("--events", type=int, default=3000, help="events per user")
    p.add_argument("--max-len", type=int, default=3000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for rows in sorted(a.rows):  # ascending: ru_maxrss of children is a running maximum
            print(json.dumps(measure(rows, max(1, int(rows * a.users_per_row)), a.events, a.max_len,
                                     Path(d))),
                  flush=True)


if __name__ == "__main__":
    main()
