"""The table of scripts/gpu_end_to_end.sh from the files its stages left in OUTDIR:
python scripts/gpu_end_to_end_table.py OUTDIR (markdown on stdout). A stage whose file is
missing shows as not run."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

GLUE_STEPS_TARGET = 100       # optimizer steps/s at base, batch 32, length 128, bf16
COMPILE_SHARE_TARGET = 0.15   # of a task's wall time


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def compile_share(task: dict) -> float:
    """A task's compile seconds over its wall time (glue_results.json's task entry)."""
    return task["compile_seconds"] / max(task["wall_seconds"], 1e-9)


def dev_metrics(task: dict) -> str:
    """A task's median dev metrics, in percent."""
    return ", ".join(f"{split} {m} {100 * v:.1f}" for split, ms in task["median"].items() for m, v in ms.items())


def glue_table(title: str, glue: dict | None) -> list[str]:
    """A GLUE run's tasks: steps/s (the training loop's, compilation excluded), compile seconds
    and share of the task's wall time, each against its target."""
    if not glue:
        return [f"**{title}**: not run or no task finished", ""]
    lines = [f"**{title}**", "",
             "| task | seeds | steps | steps/s (median of seeds) | compile s | wall s | compile share | dev metrics |",
             "|---|---|---|---|---|---|---|---|"]
    fast = small = 0
    for name, task in glue["tasks"].items():
        seeds = list(task["seeds"].values())
        steps_s = statistics.median(seed["train_steps_per_sec"] for seed in seeds)
        share = compile_share(task)
        fast += steps_s >= GLUE_STEPS_TARGET
        small += share <= COMPILE_SHARE_TARGET
        lines.append(f"| {name} | {len(seeds)} | {seeds[0]['steps']} | {steps_s:.1f} | "
                     f"{task['compile_seconds']:.1f} | {task['wall_seconds']:.1f} | {100 * share:.0f}% | "
                     f"{dev_metrics(task)} |")
    for name, why in glue.get("failed", {}).items():
        lines.append(f"| {name} | failed: {why} | | | | | | |")
    done = len(glue["tasks"])
    lines.append(f"\nTargets: >= {GLUE_STEPS_TARGET} steps/s met by {fast} of {done} tasks; compile <= "
                 f"{100 * COMPILE_SHARE_TARGET:.0f}% of a task's wall time met by {small} of {done}.")
    return lines + [""]


def stage_logs(out: Path) -> dict[str, list[str]]:
    """Each stage's lines of log.txt (between its "=== NAME (limit" and "=== NAME: exit" lines)."""
    logs: dict[str, list[str]] = {}
    current = None
    for line in ((out / "log.txt").read_text(errors="replace").splitlines() if (out / "log.txt").is_file() else []):
        if line.startswith("=== "):
            name = line[4:].split(" ", 1)[0].rstrip(":")
            current = name if " (limit " in line else None
            if current:
                logs[current] = []
        elif current:
            logs[current].append(line)
    return logs


def flags_table(out: Path, stages: dict[str, list[str]]) -> list[str]:
    """The glue_flags stage: per XLA flag set (each a cold run in its own process), a task's
    compile seconds beside its steps/s, so a set that cuts compile time by slowing the
    program shows as such. A set that did not finish shows its exit and its log's last line."""
    sets = sorted(out.glob("glue_flags*.txt"), key=lambda p: int(p.stem.removeprefix("glue_flags")))
    title = "**GLUE cold compile under XLA flag sets (glue_flags)**"
    if not sets:
        return [f"{title}: not run", ""]
    lines = [title, "", "| set | XLA_FLAGS | task | compile s | steps/s | wall s | compile share | dev metrics | "
             "autotuner timeouts | exit (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    logs = stage_logs(out)
    for path in sets:
        name = path.stem
        flags = path.read_text().strip()
        flags = f"`{flags}`" if flags else "(none)"
        exit_, seconds = (stages.get(name) or ["not run", ""])[:2]
        status = f"{exit_} ({seconds})" if seconds else exit_
        timeouts = sum("Delay kernel timed out" in line for line in logs.get(name, []))
        glue = load(out / f"{name}_results.json")
        for task_name, task in (glue or {}).get("tasks", {}).items():
            seed = task["seeds"]["0"]
            lines.append(f"| {name[10:]} | {flags} | {task_name} | {task['compile_seconds']:.1f} | "
                         f"{seed['train_steps_per_sec']:.1f} | {task['wall_seconds']:.1f} | "
                         f"{100 * compile_share(task):.0f}% | {dev_metrics(task)} | {timeouts} | {status} |")
        failed = dict((glue or {}).get("failed", {}))
        if not glue:
            last = [line.strip() for line in logs.get(name, []) if line.strip()]
            failed["-"] = "no result" + (f": {last[-1][:160]}" if last else "")
        for task_name, why in failed.items():
            lines.append(f"| {name[10:]} | {flags} | {task_name} | {why} | | | | | {timeouts} | {status} |")
    lines.append("\nEach set compiled cold (its own empty compilation cache, its own process); where the "
                 "empty set ran more than once, their difference is the noise. A set helps where it cuts compile s "
                 f"without cutting steps/s; the target is compile <= {100 * COMPILE_SHARE_TARGET:.0f}% of the "
                 "task's wall time.")
    return lines + [""]


def main(out: Path) -> str:
    lines = ["| stage | exit | seconds |", "|---|---|---|"]
    stages = out / "stages.tsv"
    rows = [row.split("\t") for row in (stages.read_text().splitlines() if stages.is_file() else [])]
    for row in rows:
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")

    summary = load(out / "pretrain_summary.json")
    if summary:
        mfu = summary.get("mfu")
        lines.append(f"**Pretraining**: {summary.get('tokens_per_sec', 0):,.0f} tokens/s, "
                     f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
                     f"final loss {summary.get('final_loss', summary.get('loss', 'n/a'))}, "
                     f"{summary.get('wall_time_s', 'n/a')} s wall")
    else:
        lines.append("**Pretraining**: not run or did not finish")
    lines.append("")

    for title, name in (("GLUE, cold compilation cache", "glue_results.json"),
                        ("GLUE, warm compilation cache (filled by the run above)", "glue_warm_results.json")):
        lines += glue_table(title, load(out / name))
    lines.append("")

    loop = load(out / "glue_loop.json")
    if loop:
        lines += [f"**GLUE loop (bench glue_loop)**: {'; '.join(loop.get('notes', []))}", "",
                  "| loop | steps per call | padding | steps/s (median, min, max) | host ms/step |",
                  "|---|---|---|---|---|"]
        for row in loop["rows"]:
            lines.append(f"| {row['variant']} | {row['steps_per_call']} | {row.get('padding', 'step')} | "
                         f"{row['steps_s']:.1f} ({row['steps_s_min']:.1f}, {row['steps_s_max']:.1f}) | "
                         f"{row['host_ms_step']:.3f} |")
        lines.append("\n`bare` feeds the same program batches already on the device: near `finetune`, the "
                     "device paces a step; far above it, the host does. Padding `step`: one program with "
                     "a branch per padded length (on a GPU a host wait per step); `call`: a call's steps "
                     "padded to their longest, no branch; `packed`: a step's examples end to end in "
                     "full-length rows, no branch.")
    else:
        lines.append("**GLUE loop (bench glue_loop)**: not run")
    lines.append("")

    lines += flags_table(out, {row[0]: row[1:] for row in rows if row})

    parity = load(out / "parity.json")
    lines.append(f"**HF export parity**: {parity}" if parity else "**HF export parity**: not run")
    lines.append("")

    peers = load(out / "hf.json")
    if peers:
        lines += ["| impl | ms/step | tokens/s | ours_x (median, min, max) | MFU vs bf16 matmul |", "|---|---|---|---|---|"]
        for row in peers["rows"]:
            ratio = (f"{row['ours_x']:.2f} ({row['ours_x_min']:.2f}, {row['ours_x_max']:.2f})"
                     if "ours_x" in row else "")
            mfu = f"{100 * row['mfu']:.1f}%" if "mfu" in row else ""
            lines.append(f"| {row['impl']} | {row['ms_step']:.1f} | {row['tokens_s']:,.0f} | {ratio} | {mfu} |")
        for note in peers.get("notes", []):
            lines.append(f"\nnote: {note}")
    else:
        lines.append("**Peers (bench hf)**: not run")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main(Path(sys.argv[1])), end="")
