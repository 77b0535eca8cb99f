"""Peak memory and speed of ``opengem import`` on a generated two-stream log, at several sizes.

    python benchmarks/import_memory.py --quick   # 1e5 and 2e5 impressions: minutes on 2 cores
    python benchmarks/import_memory.py           # 1e6 and 1e7 impressions, 1e6 users

Each size: the log is written (``opengem.data.sources.fake_log``: impressions, an events table and
an ad-click table whose items are the impressions' ``item_id``, both shuffled) to a temporary
directory, then imported by ``opengem.data.sources.generic.convert`` in a fresh process that
reports its own peak RSS (``VmHWM``: the importer's whole footprint, DuckDB's included; not
``ru_maxrss``, which Linux carries over from the forking parent, the log's writer). One JSON line
per size, then one JSON line of headline figures: per size rows, events, seconds, events/s and peak RSS,
and the slope of peak RSS per impression row between the smallest and the largest size (the goal:
about zero, memory bounded by chunks and per-user state, not by rows).

``--small-bounds`` shrinks the bounds (DuckDB's memory limit, the events per bucket, the rows per
chunk) so that logs of CPU size already reach them: the flat slope then shows at ``--quick`` sizes.
Another version of the package is measured by running this file from its checkout with
``PYTHONPATH=.`` (the child imports ``opengem`` from the working directory).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, json, resource
from opengem.data.sources import event_log, generic
from opengem.data.sources.fake_log import spec
try:
    from opengem.data.sources import impressions
except ImportError:  # an importer from before the chunked one: the "before" figures
    impressions = None
small = sys.argv[5] == "1"
if small:
    setattr(impressions or event_log, "MEMORY_LIMIT", "64MB")
    event_log.EVENTS_PER_BUCKET = 100_000
chunks = {"chunk_rows": 8192 if small else 65_536} if impressions else {}
m = generic.convert(sys.argv[1], sys.argv[2], spec(max_len=int(sys.argv[3]),
                    ad_clicks=int(sys.argv[4])), **chunks)
try:
    hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM"))
except OSError:
    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"buckets": m.source["storage"]["buckets"], "layout": m.layout,
                  "peak_rss_mib": hwm / 1024}))
"""


def measure(rows: int, users: int, events_per_row: float, ad_share: float, max_len: int,
            work: Path, small_bounds: bool = False) -> dict:
    """Write a log of ``rows`` impressions and ``events_per_row`` events per impression (a share
    ``ad_share`` of them ad clicks), import it in a child process, and return its figures."""
    from opengem.data.sources.fake_log import write_log

    per_user = max(1, round(events_per_row * rows / users))
    ads = max(1, round(per_user * ad_share))
    log = write_log(work / f"log-{rows}", rows=rows, users=users, events_per_user=per_user - ads,
                    ad_clicks_per_user=ads, chunk_users=max(500, 2_000_000 // per_user))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(log), str(work / f"out-{rows}"),
                          str(max_len), str(max(1, max_len // 4)), str(int(small_bounds))],
                         check=True, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    # the child's own JSON line (the last line that is one: anything else on stdout is not ours)
    child = json.loads(next(x for x in reversed(out.stdout.splitlines()) if x.startswith("{")))
    events = users * per_user
    return {"rows": rows, "users": users, "events": events, "seconds": round(secs, 1),
            "events_per_s": round(events / secs), "rows_per_s": round(rows / secs),
            "peak_rss_mib": round(child.pop("peak_rss_mib")), **child}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="CPU-sized: 1e5 and 2e5 impressions, 10 per user (minutes on 2 cores)")
    p.add_argument("--rows", type=int, nargs="+", default=None,
                   help="impressions per size (default 1e6 1e7; --quick 1e5 2e5)")
    p.add_argument("--users", type=int, default=None,
                   help="users at every size (default 1e6; --quick: rows / 10)")
    p.add_argument("--events-per-row", type=float, default=10.0,
                   help="events of both streams per impression (1e8 at 1e7 impressions)")
    p.add_argument("--ad-share", type=float, default=0.2, help="the ad-click stream's share")
    p.add_argument("--max-len", type=int, default=200, help="the first stream's max_len; the "
                   "ad-click stream's is a quarter of it")
    p.add_argument("--small-bounds", action="store_true",
                   help="64 MB for DuckDB, 1e5 events per bucket, 8192 rows per chunk")
    a = p.parse_args()
    sizes = a.rows or ([100_000, 200_000] if a.quick else [1_000_000, 10_000_000])
    out = []
    with tempfile.TemporaryDirectory() as d:
        for rows in sorted(sizes):
            users = a.users or (max(1, rows // 10) if a.quick else 1_000_000)
            r = measure(rows, users, a.events_per_row, a.ad_share, a.max_len, Path(d),
                        a.small_bounds)
            print(json.dumps(r), flush=True)
            out.append(r)
    lo, hi = out[0], out[-1]
    slope = ((hi["peak_rss_mib"] - lo["peak_rss_mib"]) * 2**20 / (hi["rows"] - lo["rows"])
             if hi["rows"] > lo["rows"] else None)
    print(json.dumps({"benchmark": "import_memory", "quick": a.quick,
                      "bounds": "small" if a.small_bounds else "default",
                      "sizes": [{k: r[k] for k in ("rows", "events", "seconds", "events_per_s",
                                                   "peak_rss_mib")} for r in out],
                      "rss_bytes_per_row": None if slope is None else round(slope, 1)}))


if __name__ == "__main__":
    main()
