#!/usr/bin/env bash
# Prepares torchtitan's Kimi K3 port (pytorch/torchtitan pull request 4025) as a peer for the GPU machine, which
# has no network (issues 39 and 40). Idempotent; run here, then carry the two gitignored folders it fills:
#
#   bash benchmarks/setup_torchtitan.sh
#
# third_party/torchtitan/torchtitan   `git archive refs/pull/4025/head:torchtitan` (third_party/torchtitan goes on
#                                     sys.path; benchmarks/torchtitan_port.py does that and applies the shims)
# .whl/                               the port's imports that torch 2.11 + numpy lack, as py3.12 x86_64 wheels
#                                     (all pure Python): install on the GPU machine with
#                                     python -m pip install --no-index --no-deps .whl/*.whl
#
# TORCHTITAN_GIT: the fetched torchtitan git directory (default: the search tool's mirror). The PR head is pinned:
# a different commit is refused unless TORCHTITAN_ANY_COMMIT=1.
set -euo pipefail
cd "$(dirname "$0")/.."

PIN=dee45e35721d24b8ab959a93140d0f799734eed1
REF=refs/pull/4025/head
GIT_DIR_DEFAULT=/work/.mirror/pytorch+torchtitan/repo
[ -d "$GIT_DIR_DEFAULT" ] || GIT_DIR_DEFAULT=/work/.mirror/pytorch+torchtitan
GIT=${TORCHTITAN_GIT:-$GIT_DIR_DEFAULT}
DEST=third_party/torchtitan
STAMP=$DEST/COMMIT

# --- the tree
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PIN" ] && [ -f "$DEST/torchtitan/models/kimi_k3/model.py" ]; then
  echo "torchtitan tree: $DEST at $PIN (already there)"
else
  if ! commit=$(git --git-dir="$GIT" rev-parse --verify -q "$REF^{commit}"); then
    echo "no $REF in $GIT: fetch github:pytorch/torchtitan with the search tool's fetch, or set TORCHTITAN_GIT" >&2
    exit 1
  fi
  if [ "$commit" != "$PIN" ] && [ "${TORCHTITAN_ANY_COMMIT:-0}" != 1 ]; then
    echo "$REF is $commit, not the pinned $PIN (set TORCHTITAN_ANY_COMMIT=1 to take it)" >&2
    exit 1
  fi
  rm -rf "$DEST.part"
  mkdir -p "$DEST.part/torchtitan"
  # only the package: the repository's large test assets are not in the mirror
  git --git-dir="$GIT" archive "$commit:torchtitan" | tar -x -C "$DEST.part/torchtitan"
  echo "$commit" > "$DEST.part/COMMIT"
  rm -rf "$DEST"
  mv "$DEST.part" "$DEST"
  echo "torchtitan tree: $DEST at $commit"
fi

# --- the wheels (python 3.12, linux x86_64, no dependencies resolved: the list is complete by itself)
WHEELS=(
  "fla-core==0.6.0"           # fla.ops.kda.chunk_kda (Triton >= 3.3; needs einops)
  "einops==0.8.2"             # fla's import
  "spmd-types==0.2.3"         # import spmd_types (torchtitan.models.common)
  "tyro==1.0.16"              # torchtitan.config
  "docstring-parser==0.18.0"  # tyro's
  "typeguard==4.6.0"          # tyro's
  "typing-extensions==4.16.0" # typeguard needs >= 4.14
  "packaging==26.4"           # fla's import
)
mkdir -p .whl
missing=()
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*} version=${spec##*==}
  stem=$(echo "$name" | tr '-' '_')
  compgen -G ".whl/${stem}-${version}-*.whl" > /dev/null || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
  python3 -m pip download -q -d .whl --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any --no-deps "${missing[@]}"
fi
echo "wheels in .whl: ${WHEELS[*]}"
