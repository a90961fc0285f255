"""The table of scripts/bench_accelerator.sh's ab step from the files it left in OUTDIR:
python scripts/bench_ab_table.py OUTDIR FLAG_SETS writes OUTDIR/ab.json and prints it.

- rows: every row of ab_levers.json and ab_flags1..FLAG_SETS.json, each with x_baseline, its
  tokens/s over the flag-free baseline of its shape (across processes, so coarser than the
  levers' own x_tokens);
- peers: from ab_hf.json, ours (with the levers the A/B adopted) over transformers +
  torch.compile on the same GPU (ours_x), and before the levers (ours_x_before: ours_x over
  the levers' own x_tokens of the variant ab_hf ran, at that shape).
A file that is missing is a note, not an error."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from roformer.bench.common import format_table, write_json

COLUMNS = ["run", "stage", "size", "seq", "batch", "variant", "xla_flags", "ms_step", "tokens_s", "mfu", "x_tokens",
           "x_tokens_min", "x_tokens_max", "x_baseline", "loss_step1", "dloss_step1", "dgrad_step1", "program",
           "failed"]
PEER_COLUMNS = ["shape", "peer", "forms", "dropout_rng", "ours_mfu", "ours_x", "ours_x_min", "ours_x_max", "x_levers",
                "ours_x_before"]


def lever_rows(out: Path, flag_sets: int) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    for path in [out / "ab_levers.json", *(out / f"ab_flags{i}.json" for i in range(1, flag_sets + 1))]:
        if not path.is_file():
            notes.append(f"{path.name}: no result (log.txt says why)")
            continue
        result = json.loads(path.read_text())
        rows += [{"run": path.stem, **row} for row in result["rows"]]
        notes += [f"{path.stem}: {note}" for note in result.get("notes", [])]
    baseline = {}
    for row in rows:   # the first timed baseline row of each shape: the levers' stage
        if row["run"] == "ab_levers" and row["variant"] == "baseline" and row.get("tokens_s"):
            baseline.setdefault((row["size"], row["seq"]), row)
    for row in rows:   # a variant that failed to build has a row saying why, and no times
        base = baseline.get((row["size"], row["seq"]))
        row["x_baseline"] = row["tokens_s"] / base["tokens_s"] if base and row.get("tokens_s") else None
    return rows, notes


def peer_rows(hf: dict, rows: list[dict]) -> list[dict]:
    """Each peer of ab_hf.json against ours, after the levers ab_hf ran with and before them."""
    ours = next((row for row in hf["rows"] if row["impl"] == "ours_jax"), None)
    forms, rng = sorted(hf["backend_forms"]), hf["settings"]["dropout_rng_impl"]
    peers = []
    for row in hf["rows"]:
        if row["impl"] == "ours_jax" or not row.get("ours_x"):
            continue
        same = next((r for r in rows if r["run"] == "ab_levers" and r.get("x_tokens")
                     and [r["size"], str(r["seq"]), str(r["batch"])] == row["shape"].split("/")
                     and sorted(r.get("forms", [])) == forms and r.get("dropout_rng") == rng), None)
        x_levers = same["x_tokens"] if same else None
        peers.append({"shape": row["shape"], "peer": row["impl"], "forms": ",".join(forms) or "none",
                      "dropout_rng": rng, "ours_mfu": ours.get("mfu") if ours else None, "ours_x": row["ours_x"],
                      "ours_x_min": row.get("ours_x_min"), "ours_x_max": row.get("ours_x_max"), "x_levers": x_levers,
                      "ours_x_before": row["ours_x"] / x_levers if x_levers else None})
    return peers


def main(out: Path, flag_sets: int) -> None:
    rows, notes = lever_rows(out, flag_sets)
    peers = []
    if (out / "ab_hf.json").is_file():
        hf = json.loads((out / "ab_hf.json").read_text())
        peers = peer_rows(hf, rows)
        notes += [f"ab_hf: {note}" for note in hf.get("notes", [])]
    else:
        notes.append("ab_hf.json: no result (log.txt says why)")
    write_json(out / "ab.json", {"rows": rows, "columns": COLUMNS, "peers": peers, "peer_columns": PEER_COLUMNS,
                                 "notes": notes})
    print(format_table(rows, COLUMNS))
    if peers:
        print(format_table(peers, PEER_COLUMNS))
    for note in notes:
        print("note:", note)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
