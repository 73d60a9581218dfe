#!/usr/bin/env bash
# quack-kernels and nvidia-cutlass-dsl (the Hopper GEMMs with fused epilogues of issue 48) to the device machine.
# Their wheels (about 97 MiB, one of 88 MiB) are more than one device call carries (64 MiB with the working tree),
# so they travel in two git-ignored folders, each under 60 MiB, carried by two calls made back to back while the
# machine is warm (a folder one call carried stays there for the next unless that call names it in `carry`).
#
#   bash bench/hopper_wheels.sh split     here: $WHL_SRC's wheels -> $WHL_DEST/qa and $WHL_DEST/qb; a wheel over
#                                         $PART_MIB MiB goes as two parts made by `split -b` (one in each folder)
#   bash bench/hopper_wheels.sh install   on the device: the parts joined with `cat` and checked against the
#                                         sha256 list made by `split`, every wheel into $SITE with --no-deps
#                                         (torch, triton, cuda-bindings are the machine's own), then `import quack`
#   bash bench/hopper_wheels.sh check     the versions of what the wheels need and do not bring, and the driver
#
# Defaults: WHL_SRC=.whl/quack WHL_DEST=.whl SITE=/tmp/hopper/site-packages PART_MIB=48; PIP_EXTRA (more `pip install` arguments,
# e.g. to unpack the cp312 wheels on another Python: --python-version 3.12 --platform manylinux_2_28_x86_64
# --implementation cp --only-binary=:all:); CHECK_IMPORT=0 skips the import check (a machine without CUDA).
# The two device calls (bench/suites/hopper.toml says the same):
#   run(command="bash bench/hopper_wheels.sh check", carry=[".whl/qa", ".commit"])
#   run(command="bash bench/hopper_wheels.sh install && PYTHONPATH=/tmp/hopper/site-packages:. python3 -m bench.run hopper
#       --deadline 500", carry=[".whl/qb"])
set -euo pipefail
cd "$(dirname "$0")/.."
WHL_SRC=${WHL_SRC:-.whl/quack}
WHL_DEST=${WHL_DEST:-.whl}
# SITE's path holds /site-packages/: quack fingerprints an epilogue's functions by source and globals unless they live
# under such a path, and cutlass-dsl's hold a Logger it cannot fingerprint (every epilogue GEMM failed from /tmp/site)
SITE=${SITE:-/tmp/hopper/site-packages}
PART_MIB=${PART_MIB:-48}
FOLDERS=(qa qb)
MANIFEST=SHA256SUMS  # in both folders: the original wheels' sha256 (a joined wheel is checked against it)

die() { echo "hopper_wheels: error: $*" >&2; exit 2; }
size_of() { stat -c %s "$1"; }

split_wheels() {
  [ -d "$WHL_SRC" ] || die "no folder $WHL_SRC (quack_kernels, nvidia_cutlass_dsl*, apache_tvm_ffi, torch_c_dlpack_ext)"
  shopt -s nullglob
  local wheels=("$WHL_SRC"/*.whl)
  [ ${#wheels[@]} -gt 0 ] || die "no wheel in $WHL_SRC"
  local limit=$((PART_MIB * 1024 * 1024)) f base
  for f in "${FOLDERS[@]}"; do rm -rf "${WHL_DEST:?}/$f"; mkdir -p "$WHL_DEST/$f"; done
  (cd "$WHL_SRC" && sha256sum -- *.whl) > "$WHL_DEST/qa/$MANIFEST"
  cp "$WHL_DEST/qa/$MANIFEST" "$WHL_DEST/qb/$MANIFEST"
  # pieces: a wheel over the limit as two halves (part-aa to qa, part-ab to qb), the others whole, each whole one
  # to the lighter folder, largest first
  local -A load=([qa]=0 [qb]=0)
  local big=() small=()
  for f in "${wheels[@]}"; do
    if [ "$(size_of "$f")" -gt "$limit" ]; then big+=("$f"); else small+=("$f"); fi
  done
  for f in "${big[@]}"; do
    base=$(basename "$f")
    local half=$(( ($(size_of "$f") + 1) / 2 ))
    [ "$half" -le "$limit" ] || die "$base is over twice $PART_MIB MiB: two calls do not carry it"
    split -b "$half" -a 2 -- "$f" "$WHL_DEST/qa/$base.part-"
    mv "$WHL_DEST/qa/$base.part-ab" "$WHL_DEST/qb/"
    load[qa]=$((load[qa] + half)); load[qb]=$((load[qb] + $(size_of "$f") - half))
  done
  local sorted
  mapfile -t sorted < <(for f in "${small[@]}"; do echo "$(size_of "$f") $f"; done | sort -rn | cut -d' ' -f2-)
  for f in "${sorted[@]}"; do
    local to=qa; [ "${load[qb]}" -lt "${load[qa]}" ] && to=qb
    cp -- "$f" "$WHL_DEST/$to/"
    load[$to]=$((load[$to] + $(size_of "$f")))
  done
  for f in "${FOLDERS[@]}"; do
    local mib=$(( ($(du -sb "$WHL_DEST/$f" | cut -f1) + 1048575) / 1048576 ))
    [ "$mib" -lt 60 ] || die "$WHL_DEST/$f is $mib MiB (over 60): lower PART_MIB"
    echo "$WHL_DEST/$f: $mib MiB: $(cd "$WHL_DEST/$f" && ls | grep -v "^$MANIFEST$" | tr '\n' ' ')"
  done
}

join_wheels() {  # $1: the folder the whole wheels are gathered in
  local out=$1 f base
  for f in "${FOLDERS[@]}"; do
    [ -f "$WHL_DEST/$f/$MANIFEST" ] ||
      die "$WHL_DEST/$f is missing: carry .whl/qa in one call and .whl/qb in the next, back to back"
  done
  cmp -s "$WHL_DEST/qa/$MANIFEST" "$WHL_DEST/qb/$MANIFEST" ||
    die "$WHL_DEST/qa and $WHL_DEST/qb come from different splits"
  rm -rf "$out"; mkdir -p "$out"
  shopt -s nullglob
  for f in "$WHL_DEST"/qa/*.whl "$WHL_DEST"/qb/*.whl; do cp -- "$f" "$out/"; done
  for f in "$WHL_DEST"/qa/*.whl.part-aa; do
    base=$(basename "$f" .part-aa)
    [ -f "$WHL_DEST/qb/$base.part-ab" ] || die "$base.part-ab is not in $WHL_DEST/qb"
    cat "$f" "$WHL_DEST/qb/$base.part-ab" > "$out/$base"
  done
  local sums; sums=$(realpath "$WHL_DEST/qa/$MANIFEST")
  (cd "$out" && sha256sum --quiet -c "$sums") || die "a wheel here differs from the one split"
}

install_wheels() {
  local joined=${TMPDIR:-/tmp}/hopper_wheels
  join_wheels "$joined"
  local wheels=("$joined"/*.whl)
  # shellcheck disable=SC2086 # PIP_EXTRA is a list of arguments
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" ${PIP_EXTRA:-} "${wheels[@]}"
  rm -rf "$joined"
  for pkg in torch triton nvidia cuda; do  # the machine's own (nvidia: the CUDA runtime wheels); --no-deps adds none
    [ ! -e "$SITE/$pkg" ] || die "$SITE/$pkg is there: $SITE must not shadow the machine's own $pkg"
  done
  echo "hopper_wheels: installed into $SITE: $(ls "$SITE" | grep -v dist-info | tr '\n' ' ')"
  [ "${CHECK_IMPORT:-1}" = 1 ] || return 0
  PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c '
import sys, time
from bench.bench_hopper_gemm import import_quack
t = time.perf_counter()
lib, why = import_quack()
if lib is None:
    sys.exit(f"hopper_wheels: import quack failed: {why}")
import quack, torch
print(f"hopper_wheels: import quack {quack.__version__} ok ({time.perf_counter() - t:.1f} s) from {quack.__file__}; "
      f"torch {torch.__version__} from {torch.__file__}")'
}

check_machine() {  # what the wheels need and do not bring (their METADATA's Requires-Dist), as this machine has it
  python3 - <<'PY'
from importlib.metadata import PackageNotFoundError, version
NEEDS = {"torch": "", "triton": "quack's autotuner", "cuda-bindings": ">=12.8", "protobuf": ">=4.21.12",
         "typing_extensions": ">=4.13", "einops": "", "numpy": "", "packaging": "torch-c-dlpack-ext"}
for name, why in NEEDS.items():
    try:
        have = version(name)
    except PackageNotFoundError:
        have = "MISSING"
    print(f"hopper_wheels: {name:18s} {have:14s} {why}")
PY
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
}

case "${1:-}" in
  split) split_wheels ;;
  install) install_wheels ;;
  check) check_machine ;;
  *) die "usage: bash bench/hopper_wheels.sh split|install|check" ;;
esac
