#!/usr/bin/env bash
# The position-scheme comparison of configs/study.py:VARIANT in one command (docs/study.md).
# gpu_tiny, gpu_mini and gpu_small train every scheme's grid within the default time limits on
# one H100 or H200; the rates beyond a grid's edge (study.extend_edges) may need the command
# again. gpu_tiny_long (gpu_tiny to 41M tokens), gpu_tiny_end (rope and learned to 82M: the
# end state, docs/end-state.md) and gpu_mini_long (the downstream arm's members) take several
# such runs, each resuming the last; gpu_smoke is the same pipeline in a minute or two on a CPU.
# OUTDIR gets eight files:
#   OUTDIR/study.md, study.json, study_*.png (4)  the report
#   OUTDIR/records.tar.gz                         each scheme's record and per-item test losses,
#                                                 the data manifest and the config, the recipe
#                                                 check's result (when one ran) and the
#                                                 chosen-rate members kept for the downstream arm
#                                                 (kept/, downstream.keep_members)
#   OUTDIR/log.txt                                everything printed, with the device and versions
# The study itself runs in STUDY_WORKDIR (default /tmp/roformer-study/VARIANT): a second run on
# the same machine resumes there, skipping finished schemes; on a fresh machine,
# RESUME_FROM=an earlier run's records.tar.gz (copied there) puts its finished schemes back first
# (several archives, space-separated: e.g. one per scheme, as a study spread over machines keeps them).
# Per scheme the study takes the record whose settings are its own (the one with the most members
# when several archives hold one) and says in a line what it took and what it left; a record of
# other settings is never taken (roformer.study.records). A group still training at the
# stop is lost (records hold no checkpoints): the next run trains it again from its start.
# OUTDIR and RESUME_FROM's paths are read from where the command is run.
# A machine without the corpus reads the splits from a pack made where the corpus is, once (a
# few minutes on a 2-core CPU; gpu_tiny, gpu_mini and gpu_small share it), by
# scripts/device_files.sh with the other files a GPU machine needs (copy .device there):
#   python -m roformer.study pack --config=configs/study.py:gpu_tiny .device/study_data/wikipedia_en.npz
# Your time limit: the command stops itself at LIMIT_S seconds (530; set it to the time you
# have), and no scheme starts that would end after the config's study.time_limit_s (set it a
# little below LIMIT_S with --config.study.time_limit_s=...): what finished is
# in the report (written again from the records when the study did not exit cleanly), and the
# same command resumes with the rest. Exit status: 0 the study is whole; 3 stopped by
# study.time_limit_s, 124 by LIMIT_S (both partial: resume); anything else failed.
# RECIPE_CHECK=1: once the study is whole, the check of its warmup and batch for learned
# positions on the tuning seeds (python -m roformer.study recipe; docs/study-follow-ups.md) within what is
# left of LIMIT_S, resumed by the same command; the report then carries its result.
# Usage: scripts/gpu_comparison.sh OUTDIR VARIANT [--config.KEY=VALUE ...]
#   (PYTHON=... to choose the interpreter, STUDY_DATA=... for another pack)
set -u
out=${1:?usage: scripts/gpu_comparison.sh OUTDIR VARIANT [--config.KEY=VALUE ...]}
variant=${2:?usage: scripts/gpu_comparison.sh OUTDIR VARIANT [--config.KEY=VALUE ...]}
shift 2
case " gpu_tiny gpu_tiny_long gpu_tiny_end gpu_mini gpu_mini_long gpu_small gpu_smoke " in
  *" $variant "*) ;;
  *) echo "unknown variant '$variant'; choose gpu_tiny, gpu_tiny_long, gpu_tiny_end, gpu_mini, gpu_mini_long, gpu_small or gpu_smoke" >&2
     exit 2 ;;
esac
py=${PYTHON:-python3}
out=$(realpath -m "$out")
resume=()
for records in ${RESUME_FROM:-}; do resume+=("$(realpath -m "$records")"); done
cd "$(dirname "$0")/.." || exit 2
pack=${STUDY_DATA:-.device/study_data/wikipedia_en.npz}
extra=()
if [[ $variant != gpu_smoke ]]; then
  [[ -f $pack ]] || { echo "no data pack at $pack: make it where the corpus is with" \
    "'python -m roformer.study pack --config=configs/study.py:$variant $pack' and copy it to this machine" >&2; exit 2; }
  extra+=("--config.study.data_pack=$pack")
fi
work=${STUDY_WORKDIR:-/tmp/roformer-study/$variant}
mkdir -p "$out" "$work"
if [[ ${#resume[@]} -gt 0 ]]; then
  "$py" -m roformer.study stage "$work" "${resume[@]}" || { echo "RESUME_FROM: not staged" >&2; exit 2; }
  # The recipe check's result travels in the same archives (the last one holding it wins).
  for records in "${resume[@]}"; do tar -xzf "$records" -C "$work" recipe_check.json 2>/dev/null; done
fi
# Compiled programs outside OUTDIR, which keeps only the report, records and log; a rerun on
# the same machine loads them.
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/roformer-study-jax-cache}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } 2>&1 \
  | tee "$out/log.txt"
start=$SECONDS
timeout --signal=TERM "${LIMIT_S:-530}" "$py" -m roformer.study --config="configs/study.py:$variant" \
  --workdir="$work" "${extra[@]}" "$@" 2>&1 | tee -a "$out/log.txt"
status=${PIPESTATUS[0]}
if [[ ${RECIPE_CHECK:-0} == 1 && $status -eq 0 ]]; then
  left=$(( ${LIMIT_S:-530} - (SECONDS - start) ))
  if (( left > 30 )); then
    timeout --signal=TERM "$left" "$py" -m roformer.study recipe --config="configs/study.py:$variant" \
      --workdir="$work" "${extra[@]}" "$@" 2>&1 | tee -a "$out/log.txt"
    status=${PIPESTATUS[0]}
  else
    echo "recipe check: not started ($left s left of LIMIT_S); the same command runs it" | tee -a "$out/log.txt"
    status=3
  fi
  # The study's report again, now with the check's result (it was written before the check).
  [[ -f $work/recipe_check.json ]] && timeout 45 "$py" -m roformer.study report "$work" 2>&1 | tee -a "$out/log.txt"
fi
# The records first: they are what a later run resumes from, and an outer limit that cuts the
# report's rewrite must not cost them. Records of other settings (schemes/stale) stay behind. The
# kept members travel with them (on a fresh machine, only those this run kept: keep each run's
# archive for `python -m roformer.study downstream`, which takes several).
recipe=(); [[ -f $work/recipe_check.json ]] && recipe=(recipe_check.json)
kept=(); [[ -d $work/kept ]] && kept=(kept)
tar -czf "$out/records.tar.gz" -C "$work" --exclude=schemes/stale schemes data_manifest.json study_config.json \
  "${recipe[@]}" "${kept[@]}" 2>/dev/null
# The last report written during training, at once: an outer limit that cuts the rewrite below
# still leaves one.
cp "$work"/study.md "$work"/study.json "$work"/study_*.png "$out"/ 2>/dev/null
# Stopped before its last report (the report is written beside training, so a stop can leave it
# a group behind the records): written again from the records, without training, within 45 s.
# Status 3 is the study's own stop at study.time_limit_s, after its last report.
if [[ $status -ne 0 && $status -ne 3 && -f $work/study_config.json ]] && compgen -G "$work/schemes/*.json" >/dev/null; then
  timeout 45 "$py" -m roformer.study report "$work" 2>&1 | tee -a "$out/log.txt"
  cp "$work"/study.md "$work"/study.json "$work"/study_*.png "$out"/ 2>/dev/null
fi
case $status in
  0) what="the study is whole" ;;
  3|124|137) what="partial: records.tar.gz holds what finished; the same command with RESUME_FROM set to it trains the rest" ;;
  *) what="failed" ;;
esac
echo "gpu_comparison $variant: exit status $status after $((SECONDS - start)) s ($what)" | tee -a "$out/log.txt"
exit "$status"
