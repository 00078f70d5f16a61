# llmft training image: CUDA PyTorch, llmft's pinned dependencies (constraints.txt), llmft
# itself, and DeepSpeed's CUDA/C++ ops prebuilt for A100 (sm_80) and L4 (sm_89), so jobs
# never JIT-compile ops on the compute nodes.
#
#   docker build -t llmft:latest .
#   enroot import -o /fsx/llmft.sqsh dockerd://llmft:latest     # or /home/$USER/llmft.sqsh on GCP
#   sbatch --export=ALL,CONTAINER_IMAGE=/fsx/llmft.sqsh slurm/run_llm.slurm
#
# BASE_IMAGE must be a *devel* CUDA 12 image (nvcc is needed to build the ops) whose torch is
# the version pinned in constraints.txt; with another torch, pip replaces it with the pinned one.
#
# AWS EFA (NCCL_PROFILE=aws-efa on p4d/p5): the image carries libfabric and the aws-ofi-nccl NCCL plugin
# from AWS's EFA installer (user space only; the node provides the kernel driver). The build fails if
# either is missing. WITH_EFA=0 leaves them out (GCP, or nodes without EFA):
#   docker build --build-arg WITH_EFA=0 -t llmft:gcp .
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# ninja: fast op builds; libaio-dev: DeepSpeed's async_io op (ZeRO-Infinity NVMe offload).
RUN apt-get update \
    && apt-get install -y --no-install-recommends git ninja-build libaio-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/llmft

# EFA user space: libfabric (/opt/amazon/efa) and the aws-ofi-nccl plugin NCCL loads from LD_LIBRARY_PATH
# (/opt/amazon/ofi-nccl in current installers, /opt/amazon/aws-ofi-nccl in older ones). Pin a version
# (EFA_INSTALLER_VERSION=1.x.y) for reproducible images.
ARG WITH_EFA=1
ARG EFA_INSTALLER_VERSION=latest
RUN if [ "$WITH_EFA" = 1 ]; then \
      apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
      && mkdir /tmp/efa && cd /tmp/efa \
      && curl -fsSL -o efa.tar.gz "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
      && tar -xf efa.tar.gz && cd aws-efa-installer \
      && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
      && cd / && rm -rf /tmp/efa /var/lib/apt/lists/* \
      && ls /opt/amazon/efa/lib/libfabric.so* \
      && ls /opt/amazon/ofi-nccl/lib/libnccl-net*.so /opt/amazon/aws-ofi-nccl/lib/libnccl-net*.so 2>/dev/null | grep -q . \
      || { echo "EFA installer ${EFA_INSTALLER_VERSION}: libfabric or the aws-ofi-nccl plugin is missing" >&2; exit 1; }; \
    fi
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/aws-ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH}

# Dependencies first (cached layer): torch before deepspeed, whose build imports it.
COPY constraints.txt ./
RUN pip install -c constraints.txt torch

# DeepSpeed from source with its ops compiled now. There is no GPU during `docker build`, so
# DS_ACCELERATOR=cuda stops DeepSpeed from falling back to its CPU accelerator, and
# TORCH_CUDA_ARCH_LIST says which GPUs to compile for: 8.0 = A100, 8.9 = L4, 9.0 = H100/H200 (a3, p5). Prebuilt ops
# carry no PTX, so a GPU missing here fails at the first optimizer step ("no kernel image is available").
ENV TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0"
RUN DS_ACCELERATOR=cuda DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_UTILS=1 DS_BUILD_AIO=1 \
    MAX_JOBS=8 pip install --no-build-isolation --no-binary deepspeed -c constraints.txt deepspeed

# The GPU extras (setup.cfg [gpu]: flash-attn, liger-kernel, bitsandbytes, pinned) before the source tree, so an
# edit to llmft does not rebuild flash-attn. flash-attn downloads a prebuilt wheel matching torch/CUDA/Python when
# one exists and compiles otherwise (long: MAX_JOBS bounds its memory); FLASH_ATTN_CUDA_ARCHS: A100/L4 (sm_80
# code runs on 8.9) and H100/H200 (9.0).
COPY setup.cfg ./
RUN pip install -c constraints.txt packaging psutil \
    && FLASH_ATTN_CUDA_ARCHS="80;90" MAX_JOBS=8 pip install --no-build-isolation -c constraints.txt \
       $(python -c "import configparser; c = configparser.ConfigParser(); c.read('setup.cfg'); print(c['options.extras_require']['gpu'])")

# llmft itself, with the rest of its pinned dependencies and the GPU extras (already installed above).
COPY . .
RUN pip install --no-build-isolation -c constraints.txt '.[gpu]' \
    && DS_ACCELERATOR=cuda ds_report \
    && DS_ACCELERATOR=cuda python -c "import deepspeed.git_version_info as g; \
missing = [op for op in ('cpu_adam', 'fused_adam', 'utils', 'async_io') if not g.installed_ops.get(op)]; \
assert not missing, f'DeepSpeed ops not prebuilt: {missing}'" \
    && python -c "import flash_attn, liger_kernel, bitsandbytes; print('gpu extras:', flash_attn.__version__)"

CMD ["bash"]
