#!/usr/bin/env bash
# Wheels for an offline GPU machine, carried in parts no larger than a transfer allows.
#
#   scripts/wheel_parts.sh fetch DIR [--python-version 3.12]
#   scripts/wheel_parts.sh split DIR STAGE [--max-mib 62]
#   scripts/wheel_parts.sh join STAGE DEST
#
# fetch  downloads (on a machine that reaches a package registry) the wheels that
#        scripts/gpu_check.sh needs beyond a CUDA PyTorch image: onnxruntime-gpu (CUDA 13,
#        cuDNN 9; about 255 MB), grpcio-health-checking, grpcio-reflection, grpcio-status and
#        googleapis-common-protos (the server) and psutil (its benchmark), at the versions
#        pyproject.toml pins, for CPython --python-version on x86-64 Linux: 244.5 MiB, four parts
#        of 62 MiB (uvloop, 4.3 MiB more, would make a fifth: without it gpu_check.sh runs the
#        servers on asyncio's loop).
# split  puts every wheel in DIR into one tar and cuts it into STAGE/p1 ... STAGE/pN, each
#        folder one part of at most --max-mib MiB plus the tar's SHA-256 and the part count,
#        so that each folder can travel on its own (one per call, while the machine stays up).
# join   checks that every part of STAGE is there, joins them, checks the SHA-256 and unpacks
#        the wheels into DEST. A missing, extra or altered part is named and nothing is unpacked.
#
# Then, on the GPU machine: `scripts/gpu_check.sh --parts STAGE` (joins, and installs the
# onnxruntime-gpu wheel with --ort-wheel and the others with --wheels).

set -euo pipefail

die() { echo "wheel_parts.sh: $*" >&2; exit 2; }
usage() { sed -n '2,/^$/p' "$0" | sed -e '/^$/d' -e 's/^# \{0,1\}//'; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
JOINED=""  # the joined tar while `join` checks it; removed on exit
trap '[ -z "$JOINED" ] || rm -f "$JOINED"' EXIT

pinned() {  # pinned NAME: NAME==VERSION as pyproject.toml pins it
  local line
  line=$(grep -o "\"$1==[^\"]*\"" "$REPO/pyproject.toml" | head -1 | tr -d '"') || true
  [ -n "$line" ] || die "pyproject.toml pins no version of $1"
  echo "$line"
}

fetch() {
  local dir=$1 pyver=3.12
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --python-version) pyver=$2; shift 2 ;;
      *) die "fetch: unknown argument $1 (see --help)" ;;
    esac
  done
  local wanted=() name
  for name in onnxruntime-gpu grpcio-health-checking grpcio-reflection grpcio-status googleapis-common-protos \
      psutil; do
    wanted+=("$(pinned "$name")") || exit 2
  done
  mkdir -p "$dir"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "${wanted[@]}"
  ls -l "$dir"/*.whl
}

split_parts() {
  local dir=$1 stage=$2 max_mib=62
  shift 2
  while [ $# -gt 0 ]; do
    case "$1" in
      --max-mib) max_mib=$2; shift 2 ;;
      *) die "split: unknown argument $1 (see --help)" ;;
    esac
  done
  [[ "$max_mib" =~ ^[1-9][0-9]*$ ]] || die "--max-mib must be a whole number of MiB, got '$max_mib'"
  compgen -G "$dir/*.whl" >/dev/null || die "no wheels (*.whl) in $dir; run: scripts/wheel_parts.sh fetch $dir"
  local twice
  twice=$(cd "$dir" && for w in *.whl; do echo "${w%%-*}"; done | tr 'A-Z.-' 'a-z__' | sort | uniq -d)
  [ -z "$twice" ] || die "$dir holds more than one wheel of: $(tr '\n' ' ' <<<"$twice")(an earlier fetch?); keep one version each"
  [ ! -e "$stage" ] || [ -z "$(ls -A "$stage")" ] || die "$stage is not empty; give a new folder"
  mkdir -p "$stage"
  local tarball="$stage/.wheels.tar"
  (cd "$dir" && tar -cf - -- *.whl) >"$tarball"
  local bytes parts size sha i
  bytes=$(stat -c %s "$tarball")
  parts=$(( (bytes + max_mib * 1048576 - 1) / (max_mib * 1048576) ))
  size=$(( (bytes + parts - 1) / parts ))  # parts of about equal size, each within the limit
  sha=$(sha256sum "$tarball" | cut -d' ' -f1)
  split -b "$size" -d -a 3 "$tarball" "$stage/.part."
  rm -f "$tarball"
  for ((i = 1; i <= parts; i++)); do
    mkdir "$stage/p$i"
    mv "$stage/.part.$(printf %03d $((i - 1)))" "$stage/p$i/wheels.tar.part"
    printf '%s  wheels.tar\n' "$sha" >"$stage/p$i/wheels.tar.sha256"
    echo "$parts" >"$stage/p$i/parts"
  done
  echo "$parts part(s) of at most $(( (size + 1048575) / 1048576 )) MiB in $stage (p1 .. p$parts), $bytes bytes, sha256 $sha"
}

join_parts() {
  local stage=$1 dest=$2
  [ -d "$stage" ] || die "no folder $stage"
  local first parts sha i missing=()
  first=$(compgen -G "$stage/p*/parts" | head -1) || true
  [ -n "$first" ] || die "$stage holds no parts (p1/parts ... ); make them with: scripts/wheel_parts.sh split"
  parts=$(cat "$first")
  [[ "$parts" =~ ^[1-9][0-9]*$ ]] || die "$first holds '$parts', not a part count: that part was cut short in transit; carry it again"
  sha=$(cut -d' ' -f1 "$(dirname "$first")/wheels.tar.sha256" 2>/dev/null) || true  # checked with each part below
  for ((i = 1; i <= parts; i++)); do
    [ -f "$stage/p$i/wheels.tar.part" ] || missing+=("p$i")
  done
  [ ${#missing[@]} -eq 0 ] || die "$stage lacks part(s) ${missing[*]} of $parts; carry them, then join again"
  for d in "$stage"/p*/; do
    local n=${d%/}; n=${n##*/p}
    for f in parts wheels.tar.sha256 wheels.tar.part; do
      [ -f "$d/$f" ] || die "$d lacks its $f: that part was cut short in transit; carry it again"
    done
    if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -gt "$parts" ] || [ "$(cat "$d/parts" 2>/dev/null)" != "$parts" ] \
      || [ "$(cut -d' ' -f1 "$d/wheels.tar.sha256" 2>/dev/null)" != "$sha" ]; then
      die "$d belongs to another split (its count or checksum differs from $first); remove it and join again"
    fi
  done
  JOINED=$(mktemp "${TMPDIR:-/tmp}/wheels.XXXXXX.tar")
  for ((i = 1; i <= parts; i++)); do cat "$stage/p$i/wheels.tar.part"; done >"$JOINED"
  local got
  got=$(sha256sum "$JOINED" | cut -d' ' -f1)
  [ "$got" = "$sha" ] || die "the joined parts' sha256 is $got, not $sha: a part was altered or cut short in transit; carry the parts again"
  mkdir -p "$dest"
  tar -xf "$JOINED" -C "$dest"
  echo "joined $parts part(s), sha256 $sha checked; wheels in $dest:"
  (cd "$dest" && ls -- *.whl)
}

[ $# -ge 1 ] || { usage >&2; exit 2; }
case "$1" in
  fetch) [ $# -ge 2 ] || die "fetch needs DIR"; fetch "${@:2}" ;;
  split) [ $# -ge 3 ] || die "split needs DIR and STAGE"; split_parts "${@:2}" ;;
  join) [ $# -eq 3 ] || die "join needs STAGE and DEST"; join_parts "$2" "$3" ;;
  -h|--help) usage ;;
  *) die "unknown command $1: fetch, split or join (see --help)" ;;
esac
