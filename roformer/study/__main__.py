"""The position-scheme study in one command, resumable, with a report.

    python -m roformer.study --config=configs/study.py:gpu_tiny --workdir=DIR
    python -m roformer.study pack --config=configs/study.py:gpu_tiny PATH
    python -m roformer.study split RECORDS.tar.gz DIR
    python -m roformer.study stage WORKDIR RECORDS.tar.gz...
    python -m roformer.study report WORKDIR | RECORDS.tar.gz|RECORDS_DIR DIR
    python -m roformer.study recipe --config=configs/study.py:gpu_tiny --workdir=DIR
    python -m roformer.study downstream --config=configs/study.py:VARIANT DIR WORKDIR|RECORDS.tar.gz|RECORDS_DIR...

The first trains (or resumes) every scheme's group in DIR and writes DIR/study.md; it exits
with status 3 when study.time_limit_s stopped it before its last group (the same command
resumes). `pack` writes the splits for a machine without the corpus (study.data_pack reads
them), `split` cuts a records archive into one archive per scheme, `stage` puts records
archives where the next run in WORKDIR takes their finished schemes, and `report` writes the
report of finished schemes from a workdir or records archives without training. `recipe` checks
the study's warmup and batch for recipe_check.scheme (learned) on the tuning seeds
(roformer.study.recipe_check) into DIR/recipe_check.json, which DIR's report reads; exit status
3 when study.time_limit_s stopped it (the same command resumes). `downstream` fine-tunes the
members a study kept (its workdir's kept/, or records archives holding them) on the GLUE tasks of the config's downstream section, on the CPU, in DIR (resuming there), and writes
DIR/downstream.md: which tasks separate the reference from the control, and each scheme's
paired difference to the reference.
"""
import sys
from pathlib import Path

from absl import flags

from roformer import cli

COMMANDS = {"pack": (1, 1), "split": (2, 2), "stage": (2, None), "report": (1, 2), "recipe": (0, 0), "downstream": (2, None)}   # positional counts


def main(argv):
    from roformer.study import records, session

    command, args = (argv[1], argv[2:]) if len(argv) > 1 else ("", [])
    if not command:
        train(session)
        return
    if command not in COMMANDS:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}; see --help")
    low, high = COMMANDS[command]
    if len(args) < low or (high is not None and len(args) > high):
        raise cli.UsageError(f"{command}: wrong number of arguments {args}; see --help")
    if command == "pack":
        if flags.FLAGS.config is None:
            raise cli.UsageError("pack: give --config=configs/study.py:VARIANT")
        print(session.make_pack(flags.FLAGS.config, args[0]), flush=True)
    elif command == "split":
        for path in records.split_records(Path(args[0]), Path(args[1])):
            print(f"{path}: {path.stat().st_size:,} bytes")
    elif command == "recipe":
        check_recipe(session)
    elif command == "downstream":
        downstream(args[0], args[1:])
    elif command == "stage":
        for folder in records.stage_archives(Path(args[0]), args[1:]):
            print(f"{(folder / 'SOURCE').read_text().strip()}: staged in {folder}")
    else:
        path = session.write_report(Path(args[0]), Path(args[1]) if len(args) == 2 else None)
        print(f"{path}: the report of its finished schemes")


def check_recipe(session) -> None:
    from roformer.ablation.parallel import use_compile_cache
    from roformer.ablation.runner import COMPILE_CACHE_DIR
    from roformer.study import recipe_check

    if flags.FLAGS.config is None or flags.FLAGS.workdir is None:
        raise cli.UsageError("recipe: give --config=configs/study.py:VARIANT and --workdir=DIR (the study's)")
    use_compile_cache(Path(flags.FLAGS.workdir).resolve() / COMPILE_CACHE_DIR)
    result = recipe_check.run(flags.FLAGS.config, flags.FLAGS.workdir)
    print("\n".join(recipe_check.recipe_lines(flags.FLAGS.config, result)), flush=True)
    if not result["complete"]:
        sys.exit(session.PARTIAL_EXIT)


def downstream(workdir: str, sources: list[str]) -> None:
    from roformer.study.downstream import REPORT_MD, run_downstream

    if flags.FLAGS.config is None:
        raise cli.UsageError("downstream: give --config=configs/study.py:VARIANT (its downstream section)")
    summary = run_downstream(flags.FLAGS.config, workdir, sources)
    print((Path(workdir) / REPORT_MD).read_text())
    left = f"; not fine-tuned yet: {len(summary['missing'])} run(s)" if summary["missing"] else ""
    print(f"done: report in {workdir}/{REPORT_MD}; tasks that pass the control: "
          f"{', '.join(summary['counted']) or 'none'}{left}", flush=True)


def train(session) -> None:
    from roformer.ablation.parallel import use_compile_cache
    from roformer.ablation.runner import COMPILE_CACHE_DIR
    from roformer.study.report import REPORT_MD, unfinished

    if flags.FLAGS.config is None or flags.FLAGS.workdir is None:
        raise cli.UsageError("give --config=configs/study.py:VARIANT and --workdir=DIR (or a command: "
                             f"{', '.join(COMMANDS)}; see --help)")
    # Programs a call compiled, loaded by the next (a resumed study) instead of compiled again.
    use_compile_cache(Path(flags.FLAGS.workdir).resolve() / COMPILE_CACHE_DIR)
    result = session.run_study(flags.FLAGS.config, flags.FLAGS.workdir)
    print((Path(flags.FLAGS.workdir) / REPORT_MD).read_text())
    left = unfinished(flags.FLAGS.config, result)
    if left:   # a distinct status, so a script or scheduler can tell "call again" from "done"
        print(f"partial: {' and '.join(left)} not trained yet (study.time_limit_s); the same command resumes "
              f"with them (exit status {session.PARTIAL_EXIT})", flush=True)
        sys.exit(session.PARTIAL_EXIT)
    print(f"done: report in {flags.FLAGS.workdir}/{REPORT_MD} (figures beside it), the schemes' records in "
          f"{flags.FLAGS.workdir}/schemes", flush=True)


if __name__ == "__main__":
    # Flags are defined only when run as a program: this module must stay importable next
    # to roformer.pretrain, which defines its own --config.
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "study config file (configs/study.py:VARIANT)")
    flags.DEFINE_string("workdir", None, "directory for the schemes' records and the report")
    cli.run(main, doc=__doc__, help_config=cli.CONFIG_DIR / "study.py")
