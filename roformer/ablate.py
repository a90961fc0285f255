"""Position-scheme ablation in one command, resumable, with a report.

    python -m roformer.ablate --config=configs/ablation.py --workdir=DIR
    python -m roformer.ablate --config=configs/ablation.py --workdir=DIR --report_to=OUT   # report only

For every pretraining seed and every scheme in `config.schemes`: MLM pretraining (an
ordinary pretrain workdir), length-extrapolation evaluation of the pretrained model, and
GLUE fine-tuning (an ordinary GLUE workdir). With `extension.enabled`, the pretrained
models of `extension.scheme` then continue pretraining at `extension.factor` times the
length under each of `extension.methods` (plain extrapolation, position interpolation,
NTK, YaRN, a larger RoPE base), evaluated at that length after every few steps. Layout:

    pretrain/<scheme>/seed<k>/        `tensorboard --logdir DIR/pretrain` shows them side by side
    glue/<scheme>/seed<k>/
    extension/<method>/seed<k>/
    ablation_state.json               per run and stage: done/failed, config fingerprint, results
    errors/<run>.<stage>.txt          traceback of a failed stage
    ablation.json, ablation.md, loss_curves.png, extrapolation.png, extension.png

Every scheme of one seed gets the same `config.pretrain` (data, data order, masking,
initialisation of the shared parameters, optimiser, budget); only the scheme's model
keys (model.position; attention for rope_linear) are applied on top. The seeds run in turn (every scheme of
seed 0 first), so an interrupted ablation already compares all schemes; the context
extension runs once every seed's pretraining is done. Re-running
skips stages that finished with the same config, resumes interrupted training from its
checkpoints, and retries failed stages. A failing stage is recorded (traceback in
DIR/errors/) and the other runs still go ahead. With `config.parallel` = K > 1 (CPU hosts)
the runs go K at a time, each in a process of its own with a core's share of XLA:CPU threads
(roformer.ablation.parallel; output in DIR/logs/), with the same workdirs, records and resume.
With `--report_to=OUT` the command trains nothing: it writes the report of what DIR holds now
into OUT (also while the ablation is running; runs still training count with the evaluations
they have so far).
"""
# The command line only: the library is roformer.ablation (plan -> runner -> collect -> report).
from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from roformer import cli
from roformer.ablation.plan import CONFIG_DIR
from roformer.ablation.report import REPORT_JSON, REPORT_MD
from roformer.ablation.parallel import use_compile_cache
from roformer.ablation.runner import compile_cache_dir, report_snapshot, run_ablation
from roformer.ablation.state import is_main_process


def main(argv):
    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    if "study" in flags.FLAGS.config:
        raise cli.UsageError("a study config (it has a `study` section): run it with python -m roformer.study "
                             "--config=configs/study.py:VARIANT --workdir=DIR")
    if flags.FLAGS.report_to:
        report_snapshot(flags.FLAGS.config, flags.FLAGS.workdir, flags.FLAGS.report_to)
        print((Path(flags.FLAGS.report_to) / REPORT_MD).read_text())
        print(f"done: the report of {flags.FLAGS.workdir} as it is now in {flags.FLAGS.report_to}/{REPORT_MD} and "
              f"{flags.FLAGS.report_to}/{REPORT_JSON} (figures beside them)", flush=True)
        return
    cache = compile_cache_dir(flags.FLAGS.config, Path(flags.FLAGS.workdir).resolve())
    if cache:   # this process's runs too (in turn, vmapped), before it compiles anything
        use_compile_cache(cache)
    result = run_ablation(flags.FLAGS.config, flags.FLAGS.workdir)
    if is_main_process():
        print((Path(flags.FLAGS.workdir) / REPORT_MD).read_text())
        print(done_line(flags.FLAGS.workdir, result), flush=True)
    if any(s["status"] == "failed" for s in result["runs"] + result["extension"]["runs"]):
        sys.exit(1)


def done_line(workdir: str, result: dict) -> str:
    """The command's last line: where its outputs are (those of the runs in the report `result`)."""
    runs = [f"{workdir}/pretrain"] + ([f"{workdir}/glue"] if any(r["glue_workdir"] for r in result["runs"]) else []) + (
        [f"{workdir}/extension"] if result["extension"]["runs"] else [])
    return (f"done: report in {workdir}/{REPORT_MD} and {workdir}/{REPORT_JSON} (figures beside them), "
            f"the runs in {', '.join(runs)}")


if __name__ == "__main__":
    # Flags are defined only when run as a program: this module must stay importable next
    # to roformer.pretrain, which defines its own --config.
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "ablation config file (configs/ablation.py[:smoke|reference])")
    flags.DEFINE_string("workdir", None, "directory for all runs and the report")
    flags.DEFINE_string("report_to", None, "write the report of what --workdir holds now into this directory "
                        "and train nothing (safe while the ablation runs)")
    flags.mark_flags_as_required(["config", "workdir"])
    cli.run(main, doc=__doc__, help_config=CONFIG_DIR / "ablation.py")
