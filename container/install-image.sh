#!/bin/bash
# The body of container/relax.def's %post, and what tools/build-image-root runs in its chroot:
# installs the system packages and the project's three environments into the image, each from
# its lock file (container/locks/<env>-<variant>.txt, every package pinned, installed --no-deps):
#
#   /opt/relax-hpc/.venv           the main environment: relax-hpc, torch 2.13, Ray (PATH)
#   /opt/relax-hpc/.venv-sglang    SGLang 0.5.23 with its own torch 2.14.1 ($RELAX_SGLANG_ENV)
#   /opt/relax-hpc/.venv-megatron  relax-hpc with megatron-core, megatron-bridge and
#                                  transformers 4.57 ($RELAX_MEGATRON_ENV)
#
#   container/install-image.sh VARIANT      VARIANT: cuda (the GPU image) or cpu
#
# The project's files are already in /opt/relax-hpc (relax.def's %files). Where the packages come
# from: the package index, plus for torch's CPU build $RELAX_TORCH_CPU_INDEX (default PyTorch's CPU
# index; empty: none) and any directories in $RELAX_IMAGE_FIND_LINKS (space-separated). The cpu
# variant installs the import-only stand-ins of tools/sglang_cpu_stubs and tools/megatron_cpu_stubs,
# as tools/setup-sglang-cpu and tools/setup-megatron-cpu do; the cuda variant builds Transformer
# Engine's PyTorch extension with the CUDA compiler from NVIDIA's Debian 12 repository.
set -Eeuo pipefail
variant="${1:?usage: container/install-image.sh cuda|cpu}"
case "$variant" in cuda | cpu) ;; *) echo "install-image: VARIANT is cuda or cpu, not $variant" >&2; exit 2 ;; esac
root=/opt/relax-hpc
locks="$root/container/locks"
step() { echo "install-image: [$(date +%T)] $*" >&2; }
trap 'echo "install-image: FAILED (exit $?) at: $BASH_COMMAND" >&2' ERR

step "system packages"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends python3 python3-venv ca-certificates \
    gcc g++ libc6-dev libnuma1 ibverbs-providers procps
if [ "$variant" = cuda ]; then
  apt-get install -y -q --no-install-recommends curl gnupg
  curl -fsSL -o /tmp/cuda-keyring.deb \
    https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb
  dpkg -i /tmp/cuda-keyring.deb && rm /tmp/cuda-keyring.deb
  apt-get update -q
  # The compiler and headers Transformer Engine's extension builds with (torch 2.13 is a CUDA 13 build).
  apt-get install -y -q --no-install-recommends cuda-nvcc-13-0 cuda-cudart-dev-13-0 libcublas-dev-13-0 \
      cuda-nvrtc-dev-13-0 cuda-nvtx-13-0 libcudnn9-dev-cuda-13
  export CUDA_HOME=/usr/local/cuda-13.0
fi
rm -rf /var/lib/apt/lists/*

step "uv and the build backend in $root/.image-tools (container/locks/tools.txt)"
python3 -m venv "$root/.image-tools"  # with Debian's bundled pip: it installs the pinned uv
"$root/.image-tools/bin/pip" install --quiet --no-deps --disable-pip-version-check -r "$locks/tools.txt"
uv="$root/.image-tools/bin/uv"
sources=(--index-strategy unsafe-best-match)
for dir in ${RELAX_IMAGE_FIND_LINKS:-}; do sources+=(--find-links "$dir"); done
cpu_index="${RELAX_TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"
[ -z "$cpu_index" ] || [ "$variant" != cpu ] || sources+=(--extra-index-url "$cpu_index")
export UV_LINK_MODE="${UV_LINK_MODE:-copy}"
# env NAME LOCK [uv pip install options]: a venv at $root/NAME with exactly the lock's packages.
install_env() {
  local dir="$root/$1" lock="$2"
  shift 2
  step "$dir from container/locks/$(basename "$lock")"
  python3 -m venv --without-pip "$dir"
  "$uv" pip install --quiet --python "$dir/bin/python" --no-deps --build-constraints "$locks/tools.txt" \
    "${sources[@]}" "$@" -r "$lock"
}

step "the relax-hpc wheel"
wheels="$(mktemp -d)"
(cd "$root" && "$root/.image-tools/bin/python" -m pip wheel --quiet --no-deps --no-build-isolation --no-index \
  --disable-pip-version-check -w "$wheels" .)
rm -rf "$root/build" "$root"/*.egg-info

install_env .venv "$locks/main-$variant.txt"
"$uv" pip install --quiet --python "$root/.venv/bin/python" --no-deps --no-index "$wheels"/relax_hpc-*.whl

install_env .venv-sglang "$locks/sglang-$variant.txt"

if [ "$variant" = cuda ]; then
  # Everything but Transformer Engine's extension first: it builds against the installed torch.
  grep -v '^transformer-engine-torch==' "$locks/megatron-cuda.txt" > /tmp/megatron-binary.txt
  install_env .venv-megatron /tmp/megatron-binary.txt
  step "Transformer Engine's PyTorch extension (built from source against torch; several minutes)"
  grep '^transformer-engine-torch==' "$locks/megatron-cuda.txt" > /tmp/megatron-source.txt
  "$uv" pip install --quiet --python "$root/.venv-megatron/bin/python" --no-deps --no-build-isolation \
    "${sources[@]}" -r /tmp/megatron-source.txt
  rm /tmp/megatron-binary.txt /tmp/megatron-source.txt
else
  install_env .venv-megatron "$locks/megatron-cpu.txt"
fi
"$uv" pip install --quiet --python "$root/.venv-megatron/bin/python" --no-deps --no-index "$wheels"/relax_hpc-*.whl
rm -rf "$wheels"

if [ "$variant" = cpu ]; then
  step "the CPU stand-ins (tools/sglang_cpu_stubs, tools/megatron_cpu_stubs)"
  site="$("$root/.venv-sglang/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp -r "$root"/tools/sglang_cpu_stubs/*/ "$site/"
  site="$("$root/.venv-megatron/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp -r "$root/tools/megatron_cpu_stubs" "$site/megatron_cpu_stubs"
  echo "import megatron_cpu_stubs; megatron_cpu_stubs.install()" > "$site/relax-megatron-cpu-stubs.pth"
  find "$root" -name __pycache__ -prune -exec rm -rf {} +
fi

step "check: each environment imports what it is for"
"$root/.venv/bin/python" -c "import relax_hpc, torch, ray; print('main: torch', torch.__version__)"
"$root/.venv-sglang/bin/python" -W ignore -c "import importlib.metadata as m; print('sglang:', m.version('sglang'), 'torch', m.version('torch'))"
"$root/.venv-megatron/bin/python" -W ignore -c "from megatron.bridge import AutoBridge; import megatron.core, relax_hpc, transformers; print('megatron: core', megatron.core.__version__, 'transformers', transformers.__version__)"
ln -sf "$root/.venv/bin/relax-hpc" /usr/local/bin/relax-hpc
step "done"
