#!/usr/bin/env bash
# The gpu tier, on a machine with the bundle that tests/gpu/bundle.py made (no network needed):
#
#   bash BUNDLE/run_gpu_tier.sh [BUNDLE]        # BUNDLE: this script's folder by default
#
# Installs the bundle into a temporary prefix (pip install --no-index --no-deps --target),
# checks that profinfer imports, finds its libbpf and loads a prebuilt BPF object, then runs
# `pytest tests/gpu -m gpu` for at most 8 minutes and exits with pytest's status (124: timed
# out). Without a GPU it stops after those checks with one line, and exits 77; a check that
# fails says which in one line (details in the log it names) and exits 1.
set -u
NO_GPU=77
PY=${PYTHON:-python3}
BUNDLE=$(cd "${1:-$(dirname "$0")}" && pwd) || exit 2
if [ ! -d "$BUNDLE/wheels" ]; then
    echo "gpu tier: $BUNDLE is no bundle (no wheels/): make one with python tests/gpu/bundle.py OUTDIR" >&2
    exit 2
fi
# the bundle's wheels are for the GPU image's CPython 3.12 (bundle.py): another Python cannot install them
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    echo "gpu tier: $PY is not CPython 3.12, which the bundle's wheels are for: run with PYTHON=python3.12" >&2
    exit 2
fi
# mktemp's 0700 folder: profinfer loads BPF objects only from a path nobody else can write
PREFIX=$(mktemp -d "${TMPDIR:-/tmp}/profinfer-gpu.XXXXXX") || exit 2
LOG=$PREFIX/log
done_=()
fail() { echo "gpu tier: failed at $1: $(tail -n 1 "$LOG" 2>/dev/null) (log: $LOG)"; exit 1; }

# 1. Install: profinfer, and each dependency the image lacks or has older than the bundle's
# (an image package that is as new stays: torch's own dependencies are not shadowed).
"$PY" - "$BUNDLE/wheels" >"$PREFIX/wheels.txt" 2>>"$LOG" <<'EOF' || fail "choosing wheels"
import sys, pathlib
from importlib import metadata
try:
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.version import Version
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = w.name.split("-")[:2]
    try:
        newer = Version(version) > Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        newer = True
    except Exception:          # a version that does not parse: keep the image's
        newer = False
    if newer or name == "profinfer":
        print(w)
EOF
mapfile -t wheels <"$PREFIX/wheels.txt"
if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$PREFIX/site" \
        "${wheels[@]}" >>"$LOG" 2>&1 || fail "pip install --no-index --no-deps --target $PREFIX/site"
else    # a Python without pip: these wheels install by unpacking (no scripts are needed)
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
        "$PREFIX/site" "${wheels[@]}" >>"$LOG" 2>&1 || fail "unpacking the wheels (no pip)"
fi
export PYTHONPATH="$PREFIX/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PREFIX/site/bin:$PATH"
done_+=("installed ${#wheels[@]} wheels")

# 2. The prebuilt BPF objects, where profinfer looks first; a cache of this run's own
mkdir -m 755 "$PREFIX/bpf" "$PREFIX/cache" && cp "$BUNDLE"/bpf/*.o "$PREFIX/bpf/" \
    && chmod 644 "$PREFIX"/bpf/*.o || fail "copying the BPF objects"
export PROFINFER_BPF_PREBUILT="$PREFIX/bpf" PROFINFER_CACHE="$PREFIX/cache"

# 3. libbpf: the image's if it has one profinfer can bind, else the bundle's (Debian 12's),
# with the bundle's libelf only where the image has none
libbpf_ok() { "$PY" -c "from profinfer.core.ebpf import libbpf; print(libbpf.version())" 2>>"$LOG"; }
if ! version=$(libbpf_ok); then
    mkdir -p "$PREFIX/lib" && cp "$BUNDLE/lib/libbpf.so.1" "$PREFIX/lib/"
    "$PY" -c "import ctypes; ctypes.CDLL('libelf.so.1')" 2>/dev/null || cp "$BUNDLE/lib/libelf.so.1" "$PREFIX/lib/"
    export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    version=$(libbpf_ok) || fail "loading libbpf (the image's and the bundle's)"
    version="$version (the bundle's)"
fi
done_+=("imported profinfer" "libbpf $version")

# 4. Load a BPF object: the cuda level's, from the prebuilt ones (none is built: no clang)
loaded=$("$PY" - 2>>"$LOG" <<'EOF'
import os
from profinfer.core.ebpf import bpfobj, kernel, libbpf
kernel.require_root()
variant = kernel.event_buffer_kind("auto")
for source in bpfobj.sources():                 # every object this profinfer may load is here
    path = bpfobj.object_path(source, variant)
    assert path.startswith(os.environ["PROFINFER_BPF_PREBUILT"] + "/"), f"{source}: {path} is not prebuilt"
path = bpfobj.object_path("cuda.bpf.c", variant)
obj = libbpf.BpfObject(path)
names = set(obj.program_names())
obj.load(names)
obj.close()
print(f"loaded {os.path.basename(path)} ({len(names)} programs)")
EOF
) || fail "loading the cuda level's BPF object"
done_+=("$loaded")

# 5. A GPU, as the tests see it (torch) and as the driver does (nvidia-smi); without one,
# say what did not run and stop
checks=$(sed -n 's/^def \(test_[a-z0-9_]*\).*/\1/p' "$BUNDLE/tests/gpu/test_gpu_truths.py" | paste -sd, | sed 's/,/, /g')
torch_says=$("$PY" -c "
import torch
print('' if torch.cuda.is_available() else 'torch.cuda.is_available() is False')" 2>/dev/null) \
    || torch_says="torch does not import"
if [ -n "$torch_says" ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    if [ "$gpus" -gt 0 ]; then
        echo "gpu tier: failed: nvidia-smi lists $gpus GPU(s) but $torch_says; not run: $checks"
        exit 1
    fi
    done_list=$(printf '%s; ' "${done_[@]}")
    echo "gpu tier: no GPU present ($torch_says; nvidia-smi lists none); done: ${done_list%; }; not run: $checks"
    rm -rf "$PREFIX"
    exit $NO_GPU
fi

# 6. The tests, in the bundle's copy of tests/gpu, at most 8 minutes
cd "$BUNDLE" || exit 2
timeout -k 10 480 "$PY" -m pytest -c pytest.ini -p no:cacheprovider -m gpu -v -rs tests/gpu
rc=$?
if [ $rc -eq 124 ]; then
    echo "gpu tier: pytest ran past 8 minutes"
else
    rm -rf "$PREFIX"
fi
exit $rc
