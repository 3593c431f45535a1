# kvserve: the OpenAI-compatible server on CPU.
#
#   docker build -t kvserve:0.1.0 .
#   docker build --build-arg EXTRAS=ray -t kvserve-ray:0.1.0 .   # for the RayService
#   docker run --rm -p 8000:8000 --stop-timeout 45 kvserve:0.1.0
#
# The embedded default model ships inside the Python package, so the image serves without
# any download. To serve another model, mount its directory (Hugging Face layout) and name
# it as the first argument; the CMD below then has to be repeated, since arguments replace it:
#   docker run -v /srv/models:/models:ro ... kvserve:0.1.0 /models/<name> \
#     --host 0.0.0.0 --port 8000 --state-dir /var/lib/kvserve
#
# On SIGTERM kvserve drains for up to --shutdown-timeout seconds (default 30) and then
# exits 0; `docker stop` waits only 10 s unless given --stop-timeout / -t.

FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    KVSERVE_CACHE_DIR=/var/cache/kvserve

# A C compiler with OpenMP: kvserve builds its native attention and elementwise kernels on
# first start, with -march=native for the CPU it actually runs on (which is why they are not
# built here), and caches them in $KVSERVE_CACHE_DIR. Without gcc it falls back to the
# slower torch paths.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# torch first and pinned, from the CPU wheel index: left to resolve `torch>=2.4` from the
# package's dependencies, pip would pull the default (CUDA) build, gigabytes of GPU
# libraries this image never uses. The package install below then finds torch satisfied.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# EXTRAS=ray: the image for deploy/kubernetes/rayservice.yaml, with Ray Serve (pinned to
# the manifest's rayVersion by the extra) and wget, which KubeRay's probes run.
ARG EXTRAS=""
RUN if [ -n "$EXTRAS" ]; then apt-get update \
      && apt-get install -y --no-install-recommends wget && rm -rf /var/lib/apt/lists/*; fi

# Only what the package build needs (see .dockerignore for the rest of the context).
COPY pyproject.toml README.md /src/
COPY kvserve /src/kvserve
RUN pip install --no-cache-dir "/src${EXTRAS:+[$EXTRAS]}" && rm -rf /src

# Non-root, with a numeric uid so that Kubernetes' runAsNonRoot can verify it.
# /var/lib/kvserve: --state-dir (the Batch API's SQLite database and files), usually a
# volume; /var/cache/kvserve: the compiled kernels.
RUN groupadd --system --gid 10001 kvserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/kvserve --create-home \
       --shell /usr/sbin/nologin kvserve \
    && mkdir -p /var/lib/kvserve /var/cache/kvserve \
    && chown 10001:10001 /var/lib/kvserve /var/cache/kvserve
USER 10001:10001
WORKDIR /home/kvserve

EXPOSE 8000

# For plain Docker; Kubernetes ignores it and uses the probes in deploy/kubernetes.
# It assumes the default --port 8000. /health answers 503 when the engine is not running,
# which urlopen raises as an error, so the check fails.
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["kvserve", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--state-dir", "/var/lib/kvserve"]
