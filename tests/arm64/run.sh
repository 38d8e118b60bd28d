#!/usr/bin/env bash
# The torch-free ONNX Runtime path on aarch64, under user-mode QEMU, compared with the same model on this machine;
# with --executorch, the ExecuTorch program (.pte) instead.
#
#   bash tests/arm64/run.sh [--executorch] [--cpus cortex-a72,cortex-a76] [--eval-chars N]
#
# Needs ./.venv (made by ./scripts/test.sh: it has torch, to export the demo model on this side). Everything else
# is fetched on first use and cached outside the clone, in $TXL_ARM64_CACHE (default ~/.cache/txl-deploy/arm64):
#   - qemu-aarch64 from Debian bookworm-backports' qemu-user (QEMU 10, a static binary). Bookworm's own QEMU 7.2
#     shows the guest the host's x86 /proc/cpuinfo, and onnxruntime's CPU detection then crashes on import;
#   - a Debian bookworm arm64 userland with Python 3.11, unpacked from Debian's .debs (no chroot, no root needed:
#     apt runs on a private state directory, so the machine's own apt configuration is left alone);
#   - PyPI's aarch64 wheels of our runtime dependencies (numpy, onnx, onnxruntime, click, tqdm) at the versions
#     installed on this side, so both sides run the same ONNX Runtime; no torch.
# Each piece is keyed by its versions; our own wheel is built from the checkout on every run.
# TXL_ARM64_QEMU=/path/to/qemu-aarch64 uses another QEMU (one that emulates an ARM /proc/cpuinfo);
# TXL_ARM64_DEBIAN_MIRROR and TXL_ARM64_DEBIAN_SECURITY override the Debian mirrors (default: the ones in
# /etc/apt, else deb.debian.org).
# --executorch: exports the demo model to an ExecuTorch program (XNNPACK, fp32) here and runs it through
# TxlRuntime under QEMU (tests/arm64/check_pte.py): a multi-segment batch-2 stream that wraps the memory, within the
# fp32 export tolerance of the same .pte on this machine, and the same greedy tokens. ExecuTorch's Python runtime
# needs torch, so the guest gets PyPI's aarch64 wheels of torch and executorch at this side's versions; PyPI's
# aarch64 torch is a CUDA build whose libraries link CUDA's, so its NVIDIA library wheels come too (about 3 GB
# unpacked, cached like the rest; nothing runs on a GPU). Cortex-A76 only unless --cpus says otherwise; the ONNX
# Runtime check is not run then. Not part of CI (the downloads are too large): run it by hand.
# Whatever stops the check (a failed download, a missing tool, a mismatch) is an error, never a skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
CPUS=
EVAL_CHARS=256
EXECUTORCH=0
while [ $# -gt 0 ]; do
    case "$1" in
        --cpus) CPUS=$2; shift 2 ;;
        --eval-chars) EVAL_CHARS=$2; shift 2 ;;
        --executorch) EXECUTORCH=1; shift ;;
        -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ -z "$CPUS" ]; then
    if [ "$EXECUTORCH" = 1 ]; then CPUS=cortex-a76; else CPUS=cortex-a72,cortex-a76; fi
fi

CACHE=${TXL_ARM64_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/txl-deploy/arm64}
HOST_PY=$REPO/.venv/bin/python
SUITE=bookworm
START=$(date +%s)

say() { echo "[arm64 $(( $(date +%s) - START ))s] $*"; }
die() { echo "error: $*" >&2; exit 1; }

[ -x "$HOST_PY" ] || die "no ./.venv: run ./scripts/test.sh first (it creates the environment that exports the model)"
for tool in apt-get apt-cache dpkg-deb flock sha256sum; do
    command -v "$tool" >/dev/null || die "$tool is missing: this step needs a Debian-based machine"
done
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9  # two runs on one machine share the cache: one prepares, the other waits

# The Debian mirror the machine already uses (e.g. a local proxy), else deb.debian.org.
mirror() {  # $1: debian | debian-security
    local uri
    uri=$(grep -rhv '^[[:space:]]*#' /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null \
          | grep -oE "https?://[^ ]+/$1/?( |$)" | head -n1 | tr -d ' ') || true
    echo "${uri:-http://deb.debian.org/$1}"
}
MIRROR=${TXL_ARM64_DEBIAN_MIRROR:-$(mirror debian)}
SECURITY=${TXL_ARM64_DEBIAN_SECURITY:-$(mirror debian-security)}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$KEYRING" ] || die "$KEYRING is missing (apt-get install debian-archive-keyring)"

# apt on a private state directory: $1 the directory, $2 the architecture, then the sources.list lines.
APT_OPTS=()
private_apt() {
    local dir=$1 arch=$2; shift 2
    mkdir -p "$dir/lists/partial" "$dir/archives/partial" "$dir/parts"
    [ -e "$dir/status" ] || : >"$dir/status"  # empty dpkg status: nothing installed, so apt resolves everything
    printf '%s\n' "$@" >"$dir/sources.list"
    APT_OPTS=(-o "Dir::State::Lists=$dir/lists" -o "Dir::State::status=$dir/status" -o "Dir::Cache=$dir"
              -o "Dir::Cache::archives=$dir/archives" -o "Dir::Etc::SourceList=$dir/sources.list"
              -o "Dir::Etc::SourceParts=$dir/parts" -o "Dir::Etc::Preferences=$dir/preferences"
              -o "Dir::Etc::PreferencesParts=$dir/parts" -o "APT::Architecture=$arch"
              -o "APT::Architectures::=$arch" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=$(id -un)"
              -o "Acquire::Retries=3" -o "APT::Install-Recommends=0")
    # The package lists are refreshed once a day; a failed refresh with usable lists is only a warning.
    if [ -z "$(find "$dir/.updated" -mmin -1440 2>/dev/null)" ]; then
        if apt-get "${APT_OPTS[@]}" -qq update >"$dir/update.log" 2>&1 && ! grep -q '^[EW]:' "$dir/update.log"; then
            touch "$dir/.updated"
        else
            if [ -n "$(find "$dir/lists" -maxdepth 1 -name '*Packages*' | head -n1)" ]; then
                say "warning: could not refresh the $arch package lists from $MIRROR; using the cached ones"
            else
                cat "$dir/update.log" >&2
                die "could not download the Debian $arch package lists from $MIRROR (set TXL_ARM64_DEBIAN_MIRROR)"
            fi
        fi
    fi
}

# Extract every .deb of $2 (a directory) into the new directory $1, built aside and renamed when complete.
unpack() {
    local dest=$1 debs=$2 deb
    rm -rf "$dest.tmp"
    mkdir -p "$dest.tmp"
    for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$dest.tmp"; done
    # Absolute symlinks (e.g. usr/lib/python3.11/sitecustomize.py -> /etc/...) would point into the host's own
    # files: make them relative to the unpacked root.
    (cd "$dest.tmp" && find . -type l -lname '/*' -print0 | while IFS= read -r -d '' link; do
        target=$(readlink "$link"); rel=$(dirname "${link#./}")
        if [ "$rel" = . ]; then rel=.; else rel=$(echo "$rel" | sed -E 's#[^/]+#..#g'); fi
        ln -sfn "$rel$target" "$link"
    done)
    mv "$dest.tmp" "$dest"
}

prune() {  # remove the other versions of a cached piece: $1 glob prefix, $2 the one to keep
    local old
    for old in "$CACHE/$1"*; do [ "$old" = "$2" ] || [ ! -e "$old" ] || rm -rf "$old"; done
}

# --- QEMU --------------------------------------------------------------------------------------------------------
if [ -n "${TXL_ARM64_QEMU:-}" ]; then
    QEMU=$TXL_ARM64_QEMU
else
    private_apt "$CACHE/apt-amd64" amd64 \
        "deb [arch=amd64 signed-by=$KEYRING] $MIRROR $SUITE-backports main"
    QEMU_VERSION=$(apt-cache "${APT_OPTS[@]}" show qemu-user 2>/dev/null | sed -n 's/^Version: //p' \
                   | sort -V | tail -n1)
    [ -n "$QEMU_VERSION" ] || die "no qemu-user package in $SUITE-backports at $MIRROR"
    QEMU_DIR=$CACHE/qemu-$(echo "$QEMU_VERSION" | tr ':~+' '___')
    if [ ! -x "$QEMU_DIR/qemu-aarch64" ]; then
        say "downloading qemu-user $QEMU_VERSION from $SUITE-backports"
        rm -rf "$CACHE/apt-amd64/debs" && mkdir -p "$CACHE/apt-amd64/debs"
        (cd "$CACHE/apt-amd64/debs" && apt-get "${APT_OPTS[@]}" -qq download "qemu-user=$QEMU_VERSION") \
            || die "could not download qemu-user $QEMU_VERSION from $MIRROR"
        rm -rf "$QEMU_DIR.tmp" && mkdir -p "$QEMU_DIR.tmp"
        dpkg-deb --fsys-tarfile "$CACHE"/apt-amd64/debs/*.deb | tar -x -C "$QEMU_DIR.tmp" ./usr/bin/qemu-aarch64
        mv "$QEMU_DIR.tmp/usr/bin/qemu-aarch64" "$QEMU_DIR.tmp/" && rm -rf "$QEMU_DIR.tmp/usr" "$CACHE/apt-amd64/debs"
        mv "$QEMU_DIR.tmp" "$QEMU_DIR"
    fi
    prune qemu- "$QEMU_DIR"
    QEMU=$QEMU_DIR/qemu-aarch64
fi
"$QEMU" --version >/dev/null 2>&1 || die "$QEMU does not run"
say "$("$QEMU" --version | head -n1)"

# --- Debian arm64 userland -----------------------------------------------------------------------------------
# python3.11 pulls libpython3.11-stdlib, libc6, libssl3, libffi8, libexpat1, zlib1g, ...; onnxruntime needs
# libstdc++6 and libgcc-s1.
PACKAGES=(python3.11 libstdc++6 libgcc-s1)
private_apt "$CACHE/apt-arm64" arm64 \
    "deb [arch=arm64 signed-by=$KEYRING] $MIRROR $SUITE main" \
    "deb [arch=arm64 signed-by=$KEYRING] $MIRROR $SUITE-updates main" \
    "deb [arch=arm64 signed-by=$KEYRING] $SECURITY $SUITE-security main"
PLAN=$(apt-get "${APT_OPTS[@]}" -s install "${PACKAGES[@]}" 2>&1) \
    || { echo "$PLAN" >&2; die "apt cannot resolve ${PACKAGES[*]} for arm64"; }
VERSIONS=$(echo "$PLAN" | sed -nE 's/^Inst ([^ ]+) \(([^ ]+) .*/\1 \2/p' | sort)
SYSROOT=$CACHE/sysroot-$(echo "$VERSIONS" | sha256sum | cut -c1-16)
if [ ! -x "$SYSROOT/usr/bin/python3.11" ]; then
    say "downloading the Debian $SUITE arm64 userland ($(echo "$VERSIONS" | wc -l) packages)"
    rm -f "$CACHE"/apt-arm64/archives/*.deb
    apt-get "${APT_OPTS[@]}" -qq -y install --download-only "${PACKAGES[@]}" >"$CACHE/apt-arm64/download.log" 2>&1 \
        || { cat "$CACHE/apt-arm64/download.log" >&2; die "could not download the arm64 packages from $MIRROR"; }
    unpack "$SYSROOT" "$CACHE/apt-arm64/archives"
    echo "$VERSIONS" >"$SYSROOT/.versions"
    rm -f "$CACHE"/apt-arm64/archives/*.deb
fi
prune sysroot- "$SYSROOT"
say "sysroot: $(grep -E '^(python3.11|libc6) ' "$SYSROOT/.versions" | tr '\n' ' ')"

# --- aarch64 wheels ------------------------------------------------------------------------------------------
RUNTIME_PACKAGES=(numpy onnx onnxruntime click tqdm)
# ExecuTorch's Python runtime: torch and executorch (without executorch's own requirements, which are for
# exporting: pandas, scikit-learn, coremltools, ...), and what importing executorch.runtime imports.
EXECUTORCH_PACKAGES=(torch executorch filelock typing_extensions sympy networkx jinja2 fsspec flatbuffers
                     ruamel.yaml tabulate packaging pyyaml)
[ "$EXECUTORCH" = 0 ] || RUNTIME_PACKAGES+=("${EXECUTORCH_PACKAGES[@]}")
PINS=$("$HOST_PY" - "${RUNTIME_PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name).split('+')[0]}")  # 2.13.0+cpu: a local build tag names no PyPI wheel
    except PackageNotFoundError:
        raise SystemExit(f"error: {name} is not installed in ./.venv (run ./scripts/test.sh)")
EOF
)
PLATFORM=(--python-version 3.11 --implementation cp --abi cp311 --only-binary=:all:)
if [ "$EXECUTORCH" = 0 ]; then
    PLATFORM+=(--platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64)
    SITE=$CACHE/site-$(echo "$PINS" | sha256sum | cut -c1-16)
    SITE_PREFIX=site-
else
    # pip takes only the platform tags it is given: torch's NVIDIA libraries are tagged from manylinux_2_17 up
    for glibc in 17 18 24 25 26 27 28; do PLATFORM+=(--platform "manylinux_2_${glibc}_aarch64"); done
    PLATFORM+=(--platform manylinux2014_aarch64)
    SITE=$CACHE/pte-site-$(echo "$PINS" | sha256sum | cut -c1-16)
    SITE_PREFIX=pte-site-
fi
if [ ! -f "$SITE/.complete" ]; then
    say "downloading aarch64 wheels: $(echo "$PINS" | tr '\n' ' ')"
    rm -rf "$SITE.tmp"
    # shellcheck disable=SC2046
    "$HOST_PY" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --target "$SITE.tmp" \
        "${PLATFORM[@]}" $(echo "$PINS" | grep -v '^executorch==') >"$CACHE/pip.log" 2>&1 \
        || { grep -v 'is ignored' "$CACHE/pip.log" >&2; die "could not download the aarch64 wheels from PyPI"; }
    if [ "$EXECUTORCH" = 0 ]; then
        ! [ -e "$SITE.tmp/torch" ] || die "torch was pulled into the aarch64 runtime; it must stay torch-free"
    else
        # shellcheck disable=SC2046
        "$HOST_PY" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --no-deps \
            --target "$SITE.tmp" "${PLATFORM[@]}" $(echo "$PINS" | grep '^executorch==') >>"$CACHE/pip.log" 2>&1 \
            || { grep -v 'is ignored' "$CACHE/pip.log" >&2; die "could not download executorch's aarch64 wheel"; }
    fi
    "$HOST_PY" -m pip list --path "$SITE.tmp" --format freeze 2>/dev/null >"$SITE.tmp/.complete"
    mv "$SITE.tmp" "$SITE"
fi
prune "$SITE_PREFIX" "$SITE"
flock -u 9

# --- this run: our wheel, the x86 reference, the guests ------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/txl-arm64.XXXXXX")
# kept when something fails, for a look at what each side wrote
trap 'rc=$?; if [ $rc -eq 0 ]; then rm -rf "$WORK"; else echo "(files of this run: $WORK)" >&2; fi' EXIT
say "building our wheel"
# from a copy of the checkout's files (tracked and new, not ignored): setuptools' build/ folder stays out of the
# clone, and no stale file from an earlier build can slip into the wheel
mkdir -p "$WORK/src"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null \
        | tar -x -C "$WORK/src"
else
    tar --exclude=./.venv --exclude=./build -cf - . | tar -x -C "$WORK/src"
fi
(cd "$WORK/src" && "$HOST_PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$WORK/wheel" .) >"$WORK/wheel.log" 2>&1 || { cat "$WORK/wheel.log" >&2; die "pip wheel . failed"; }
"$HOST_PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-script-location \
    --target "$WORK/own" "$WORK"/wheel/*.whl >>"$WORK/wheel.log" 2>&1 \
    || { cat "$WORK/wheel.log" >&2; die "installing our wheel failed"; }

guest() {  # $1: QEMU CPU model, then the guest Python's arguments. Clean environment: nothing of the host leaks in.
    local cpu=$1; shift
    (cd "$WORK" && env -i PATH=/usr/bin:/bin HOME="$WORK" LANG=C.UTF-8 PYTHONNOUSERSITE=1 \
        PYTHONPATH="$WORK/own:$SITE" QEMU_CPU="$cpu" QEMU_LD_PREFIX="$SYSROOT" \
        "$QEMU" "$SYSROOT/usr/bin/python3.11" "$@")
}
IFS=, read -r -a CPU_LIST <<<"$CPUS"
if [ "$EXECUTORCH" = 1 ]; then
    say "exporting the demo model to an ExecuTorch program and computing the x86 reference"
    "$HOST_PY" tests/arm64/check_pte.py reference "$WORK"
    for cpu in "${CPU_LIST[@]}"; do
        say "$cpu: the .pte's log-probs and greedy generation"
        guest "$cpu" "$REPO/tests/arm64/check_pte.py" guest "$WORK" "$cpu" || die "the aarch64 .pte failed on $cpu"
    done
    "$HOST_PY" tests/arm64/check_pte.py report "$WORK" "${CPU_LIST[@]}"
    say "done"
    exit 0
fi
say "exporting the demo model and computing the x86 reference"
"$HOST_PY" tests/arm64/check.py reference "$WORK" --eval-chars "$EVAL_CHARS"
for cpu in "${CPU_LIST[@]}"; do
    say "$cpu: log-probs and greedy generation"
    guest "$cpu" "$REPO/tests/arm64/check.py" guest "$WORK" "$cpu" || die "the aarch64 runtime failed on $cpu"
    say "$cpu: txl-deploy eval"
    guest "$cpu" "$WORK/own/bin/txl-deploy" eval "$WORK/model.onnx" --threads 1 --text "$WORK/heldout.txt" \
        --json "$WORK/eval-$cpu.json" 2>"$WORK/eval-$cpu.log" | sed "s/^/  [$cpu] /" \
        || { cat "$WORK/eval-$cpu.log" >&2; die "txl-deploy eval failed on $cpu"; }
done
"$HOST_PY" tests/arm64/check.py report "$WORK" "${CPU_LIST[@]}"
say "done"
