"""Future bar times on real bars: how often the rule names every one of an origin's next bars.

    python -m benchmarks.future_times --parquet ../shared/data/futures_1h_2019_2023.parquet

Per root of a per-contract file (its bar times: every time any of its contracts traded), the trading hours are
learnt from the bars before `--split` (`features.sessions.learn_hours`, in `--calendar-tz`); at every later bar,
as an origin, the next `--horizon` bar times come from `features.sessions.next_bar_times` twice: by the week's
hours alone, and with the root's exchange holidays and early closes (`closed_spans`). Printed: the share of origins
whose `--horizon` times all equal the bars that came, each way, and of single steps.
"""

from __future__ import annotations

import argparse

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from features.calendar import infer_bar_interval_ns
from features.sessions import learn_hours, next_bar_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parquet", required=True, help="per-contract bars with a root column")
    parser.add_argument("--split", default="2022-01-01", help="hours learnt from the bars before this date")
    parser.add_argument("--horizon", type=int, default=12)
    parser.add_argument("--calendar-tz", default="America/Chicago")
    args = parser.parse_args()
    table = pq.read_table(args.parquet, columns=["timestamp", "root"])
    split = int(np.datetime64(args.split, "ns").astype(np.int64))
    print(f"{'root':6} {'origins':>8} {'week':>7} {'+ holidays':>11} {'steps: week':>12} {'+ holidays':>11}")
    total = np.zeros(3)
    for root in sorted(pc.unique(table["root"]).to_pylist()):
        rows = table.filter(pc.equal(table["root"], root))
        ts = np.unique(rows["timestamp"].cast("int64").to_numpy())  # [N] every time a contract traded
        interval = infer_bar_interval_ns(ts, np.array([[0, ts.size]]))
        first = int(np.searchsorted(ts, split))
        hours = learn_hours(ts[:first], interval, args.calendar_tz)
        origins = np.arange(first, ts.size - args.horizon)  # [W]
        came = ts[origins[:, None] + np.arange(1, args.horizon + 1)]  # [W, H]
        n = origins.size
        times = [next_bar_times(ts[origins], interval, args.horizon, args.calendar_tz, np.array([hours] * n), series)
                 for series in (None, np.array([root] * n))]
        whole = [float((t == came).all(axis=1).mean()) for t in times]
        steps = [float((t == came).mean()) for t in times]
        total += (n, whole[0] * n, whole[1] * n)
        print(f"{root:6} {n:8d} {whole[0]:7.4f} {whole[1]:11.4f} {steps[0]:12.4f} {steps[1]:11.4f}")
    print(f"{'all':6} {int(total[0]):8d} {total[1] / total[0]:7.4f} {total[2] / total[0]:11.4f}")


if __name__ == "__main__":
    main()
