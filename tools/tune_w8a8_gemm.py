"""Tune ``qops.w8a8_gemm``'s config choice for the Llama layer shapes: time every generated tile
config at every M bucket from 1 to 8192 and write the per-shape dispatch table
``cutlass_kernels/w8a8_tuned.json`` (read by the generator: the table is data, the code is
generated from it).

Why buckets: every config's tile count in M is a function of ceil(M / 64) (64- and 128-row CTA
tiles, clusters of 1 or 2 in M), so the winner can only change at multiples of 64. Up to M = 1024
each 64-row bucket is timed at its top (its fullest tiles); above, where only 128-row tiles win,
each 128-row bucket; M <= 16 (decode) is its own bucket. Between two buckets whose best configs
are within ``--tolerance`` the earlier pick is kept (fewer switches, less noise).

Run from the repository root:

    python -m tools.tune_w8a8_gemm --out bench/out                  # on the GPU: sweep + table
    python -m tools.tune_w8a8_gemm --from-csv bench/out/tune_w8a8.csv  # rebuild the table only
    python -m tools.tune_w8a8_gemm --out bench/out --max-m 16 --merge cutlass_kernels/w8a8_tuned.json
                                     # re-tune the decode bucket only, keep the rest of the table
    python -m tools.tune_w8a8_gemm --out bench/out --layers 8B.o --ms 193,256 --repeats 3 \
        --merge cutlass_kernels/w8a8_tuned.json   # re-time one bucket of one shape, medians of 3

The shapes are bench/shapes.py's ``GEMM_LAYERS``. Check the result with a held-out sweep at other
M values: ``python -m bench.bench_w8a8_gemm --sweep --no-anchors --tokens ...`` reports auto over
best.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

from cutlass_kernels import w8a8_configs as table

DEFAULT_JSON = table.TUNED_PATH  # cutlass_kernels/w8a8_tuned.json


def buckets(max_m: int = 8192) -> list[int]:
    """The top of each M bucket."""
    ms = [16] + list(range(64, min(1024, max_m) + 1, 64))
    ms += list(range(1024 + 128, max_m + 1, 128))
    return ms


def timed_ms(max_m: int = 8192) -> list[int]:
    """The M values timed: both ends of every bucket (a partly filled tile is not always as fast
    as a full one: the 128-row cooperative tile takes 18% longer at M = 65 than at 128 on 8B.down)."""
    tops = buckets(max_m)
    return sorted(set(tops) | {1} | {t + 1 for t in tops[:-1]})


def build_table(rows: list[dict], tolerance: float) -> list[dict]:
    """Per (N, K): ``picks = [[max_m, config], ...]`` (ascending max_m, runs merged), from rows of
    ``layer, M, N, K, <config>_us...``."""
    names = table.config_names()
    tops = buckets(max(int(r["M"]) for r in rows))
    shapes: dict[tuple[int, int], dict] = {}
    for r in rows:
        key = (int(r["N"]), int(r["K"]))
        s = shapes.setdefault(key, {"layer": r["layer"], "n": key[0], "k": key[1], "buckets": {}})
        times = {c: float(r[f"{c}_us"]) for c in names if r.get(f"{c}_us") not in (None, "", "nan")}
        top = next((t for t in tops if int(r["M"]) <= t), tops[-1])
        s["buckets"].setdefault(top, []).append(times)  # several rows: both ends, repeated shapes
    out = []
    for s in shapes.values():
        picks: list[list] = []
        prev = None
        for m, points in sorted(s["buckets"].items()):
            # each config's worst slowdown over the bucket's timed points
            worst = {c: max(p[c] / min(p.values()) for p in points) for c in names if all(c in p for p in points)}
            pick = min(worst, key=worst.get)
            if prev is not None and prev in worst and worst[prev] <= worst[pick] * (1 + tolerance):
                pick = prev
            if picks and picks[-1][1] == pick:
                picks[-1][0] = m
            else:
                picks.append([m, pick])
            prev = pick
        out.append({"layer": s["layer"], "n": s["n"], "k": s["k"], "picks": picks})
    return out


def _pick_at(picks, m: int) -> str:
    return next((c for max_m, c in picks if m <= max_m), picks[-1][1])


def merge_tables(new: list[dict], old: list[dict], rows: list[dict]) -> list[dict]:
    """`new`'s picks in the M buckets that `rows` timed (per shape), `old`'s everywhere else;
    shapes only in `old` are kept as they are."""
    tops = buckets()
    timed: dict[tuple[int, int], set[int]] = {}
    for r in rows:
        m = int(r["M"])
        timed.setdefault((int(r["N"]), int(r["K"])), set()).add(next((t for t in tops if m <= t), tops[-1]))
    new_by_shape = {(s["n"], s["k"]): s for s in new}
    old_keys = {(o["n"], o["k"]) for o in old}
    out = []
    for o in old + [s for s in new if (s["n"], s["k"]) not in old_keys]:
        key = (o["n"], o["k"])
        s = new_by_shape.get(key)
        if s is None:
            out.append(o)  # not re-timed
            continue
        merged: list[list] = []
        for t in tops:
            c = _pick_at(s["picks"] if s is o or t in timed.get(key, ()) else o["picks"], t)
            if merged and merged[-1][1] == c:
                merged[-1][0] = t
            else:
                merged.append([t, c])
        out.append({**o, "picks": merged})  # the old entry's layer name
    return out  # in the old table's order (shapes new to it last): small diffs


def sweep(layers, ms, out_dir, repeats: int = 1) -> list[dict]:
    import torch

    from bench.bench_w8a8_gemm import time_configs  # the same timing (CUDA graphs, rotated L2-cold inputs)

    rows = []
    path = os.path.join(out_dir, "tune_w8a8.csv")
    t0 = time.time()
    total = len(layers) * len(ms)
    for _li, (layer, n, k) in enumerate(layers):
        for m in ms:
            r = {"layer": layer, "M": m, "N": n, "K": k}
            names = table.config_names(m)  # the configs that serve m rows
            # the configs timed interleaved (same clock and power state), `repeats` times on
            # fresh inputs, the median per config: one slow round cannot decide a bucket
            rounds = [time_configs(m, n, k, names) for _ in range(repeats)]
            times = {c: sorted(t[c] for t in rounds) for c in names}
            for c in names:
                r[f"{c}_us"] = times[c][len(times[c]) // 2]
            rows.append(r)
        done = len(rows)
        print(f"[{done}/{total}] {layer} N={n} K={k} done, {time.time() - t0:.0f} s", flush=True)
        with open(path, "w", newline="") as f:  # after every layer: a partial run is not lost
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(c for r in rows for c in r)))
            w.writeheader()
            w.writerows(rows)
        torch.cuda.empty_cache()
    print(f"wrote {path}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/out")
    p.add_argument("--from-csv", help="build the table from earlier sweeps (comma-separated CSVs) instead of timing")
    p.add_argument("--ms", help="comma-separated M values to time (default: both ends of every bucket)")
    p.add_argument("--layers", help="comma-separated layer names (default: all of bench/shapes.py's GEMM_LAYERS)")
    p.add_argument("--max-m", type=int, default=8192)
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.03,
        help="keep the previous bucket's config if within this fraction of the best",
    )
    p.add_argument(
        "--merge",
        metavar="JSON",
        help="keep this table's picks in every M bucket not timed now "
        "(re-tune some buckets, e.g. --max-m 16 after a decode kernel changed)",
    )
    p.add_argument("--repeats", type=int, default=1, help="time every point this many times, keep the median")
    p.add_argument(
        "--json",
        default=None,
        help=f"table to write (default: {DEFAULT_JSON} with --from-csv, else OUT/w8a8_tuned.json)",
    )
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.from_csv:
        rows, device, sms = [], None, None
        for path in a.from_csv.split(","):
            with open(path) as f:
                rows += list(csv.DictReader(f))
            meta_path = os.path.splitext(path)[0] + ".meta.json"
            if os.path.exists(meta_path):
                with open(meta_path) as f:
                    meta = json.load(f)
                if sms is not None and (meta["device"], meta["num_sms"]) != (device, sms):
                    p.error(f"{path} was measured on another device: {meta} vs {device}, {sms} SMs")
                device, sms = meta["device"], meta["num_sms"]
        json_path = a.json or DEFAULT_JSON
    else:
        import torch

        from bench.shapes import GEMM_LAYERS

        layers = GEMM_LAYERS
        if a.layers:
            layers = [l for l in GEMM_LAYERS if l[0] in a.layers.split(",")]
        if not torch.cuda.is_available():
            p.error("timing a sweep needs a CUDA device (--from-csv rebuilds the table without one)")
        device = torch.cuda.get_device_name()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        ms = [int(x) for x in a.ms.split(",")] if a.ms else timed_ms(a.max_m)
        print(
            f"device: {device} ({sms} SMs); {len(layers)} shapes x {len(ms)} M buckets x "
            f"{len(table.config_names())} configs",
            flush=True,
        )
        rows = sweep(layers, ms, a.out, a.repeats)
        with open(os.path.join(a.out, "tune_w8a8.meta.json"), "w") as f:
            json.dump({"device": device, "num_sms": sms}, f)
        json_path = a.json or os.path.join(a.out, "w8a8_tuned.json")
    if sms is None:
        p.error("the sweep's .meta.json (device, SM count) is missing next to the CSV")
    shapes = build_table(rows, a.tolerance)
    if a.merge:
        with open(a.merge) as f:
            old = json.load(f)
        if (old["device"], old["num_sms"]) != (device, sms):
            p.error(f"{a.merge} was tuned on {old['device']} ({old['num_sms']} SMs), not {device} ({sms} SMs)")
        shapes = merge_tables(shapes, old["shapes"], rows)
    doc = {
        "about": "qops.w8a8_gemm config per (N, K) and M bucket, written by tools/tune_w8a8_gemm.py; "
        "used only on GPUs with num_sms SMs (other problems: SELECTION's rules)",
        "device": device,
        "num_sms": sms,
        "tolerance": a.tolerance,
        "shapes": shapes,
    }
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    for s in shapes:
        print(
            f"{s['layer']:16s} N={s['n']:6d} K={s['k']:6d}: "
            + ", ".join(f"<={m}:{c.split('_c')[0]}/{c.split('_')[-1][:6]}" for m, c in s["picks"])
        )
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
