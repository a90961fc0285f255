#!/usr/bin/env bash
# The files a GPU machine without the shared data needs beside the repository, made on a machine
# that has it (no accelerator needed) in one ignored folder, DIR (default .device), to copy there:
#   DIR/wheels/                      what the accelerator image lacks, as wheels for its Python:
#                                    DEVICE_PYTHON (default 3.12) and DEVICE_WHEELS (default
#                                    flax==0.12.12 ml_collections==1.1.0 tensorboardX==2.6.5)
#   DIR/data/                        the shared data the GPU runs read (gpu_end_to_end.sh's DATA):
#                                    glue/{CoLA,MRPC,STS-B,SST-2}, vocab/, wikipedia_en/wiki_0[0-9]
#   DIR/study_data/wikipedia_en.npz  the comparison's splits (gpu_comparison.sh's STUDY_DATA): a
#                                    few minutes on a 2-core CPU; gpu_tiny, gpu_mini, gpu_small and
#                                    gpu_tiny_long share it
# PARTS picks among "wheels data pack" (default all three; wheels and data already made are
# kept, a pack made with other split settings is made again). It ends by printing DIR's size
# (MAX_MIB, if set, fails the script above that size). On the GPU machine, first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/wheels/*.whl && export PYTHONPATH=/tmp/site
# Usage: scripts/device_files.sh [DIR]   (PYTHON=... makes the pack; SHARED=... the shared data,
# default ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.device}
py=${PYTHON:-python3}
shared=${SHARED:-../shared/data}
parts=" ${PARTS:-wheels data pack} "
for part in $parts; do
  [[ " wheels data pack " == *" $part "* ]] || { echo "unknown part '$part'; choose from: wheels data pack" >&2; exit 2; }
done
mkdir -p "$dir"

if [[ $parts == *" wheels "* ]]; then
  # shellcheck disable=SC2086
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dir/wheels" \
    ${DEVICE_WHEELS:-flax==0.12.12 ml_collections==1.1.0 tensorboardX==2.6.5}
fi

if [[ $parts == *" data "* ]]; then
  [[ -d $shared/glue ]] || { echo "no shared data at $shared (SHARED=...)" >&2; exit 2; }
  mkdir -p "$dir/data/glue" "$dir/data/vocab" "$dir/data/wikipedia_en"
  for task in CoLA MRPC STS-B SST-2; do
    cp -r "$shared/glue/$task" "$dir/data/glue/"
  done
  cp "$shared"/vocab/* "$dir/data/vocab/"
  cp "$shared"/wikipedia_en/wiki_0[0-9] "$dir/data/wikipedia_en/"
fi

if [[ $parts == *" pack "* ]]; then   # says "up to date" when the pack's key is this config's
  # the corpus the config reads is the shared data's: SHARED's, unless ROFORMER_SHARED_DATA says otherwise
  ROFORMER_SHARED_DATA="${ROFORMER_SHARED_DATA:-$(realpath "$shared")}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$py" -m roformer.study pack --config=configs/study.py:gpu_tiny "$dir/study_data/wikipedia_en.npz"
fi

size=$(du -sm "$dir" | cut -f1)
echo "$dir: ${size} MiB"
[[ -z ${MAX_MIB:-} || $size -le $MAX_MIB ]] || { echo "$dir is over MAX_MIB=$MAX_MIB MiB" >&2; exit 1; }
