# syntax=docker/dockerfile:1
#
# Outbox Relay image: docker build -t outbox-relay:0.2.0 \
#   --build-arg VERSION=0.2.0 --build-arg REVISION="$(git rev-parse HEAD)" \
#   --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" .
# See docs/deploy.md; `python3 dev.py image` builds it with buildah on a Debian base. Both
# stages use the same base image, so the virtualenv's interpreter symlink resolves in the
# runtime stage (/usr/local/bin/python3 in the official image, /usr/bin/python3 in Debian's).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/relay/venv \
    PATH=/opt/relay/venv/bin:$PATH

# python3: Debian's python3 package has no `python` command.
RUN python3 -m venv /opt/relay/venv

WORKDIR /src

# Dependencies first, in their own layer: a code change does not reinstall them.
# The project's metadata plus an empty package is enough for pip to resolve `.[all]`
# (every broker client) constrained to the exact versions in requirements.lock. The
# lock also pins test-only tools; `-c` only constrains, so none of them is installed.
COPY pyproject.toml requirements.lock README.md LICENSE ./
RUN mkdir relay && touch relay/__init__.py \
 && pip install --no-cache-dir -c requirements.lock '.[all]' \
 && pip uninstall --yes outbox-relay \
 && rm -rf relay build ./*.egg-info

# Then the project itself, with no dependency resolution at all.
COPY relay ./relay
RUN pip install --no-cache-dir --no-deps . \
 && pip check \
 && relay version

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

# tini as PID 1: forwards SIGTERM to the relay and reaps children (docs/deploy.md).
# The version is the one in Debian bookworm; bump it with the base image. apt's package
# caches go too (77 MB): the official image's apt config drops them, Debian's does not.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends tini=0.19.0-1+b3 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin

# A numeric user: Kubernetes' runAsNonRoot can verify it (a name it cannot).
RUN groupadd --system --gid 10001 relay \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin relay

COPY --from=builder /opt/relay/venv /opt/relay/venv

ENV PATH=/opt/relay/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    RELAY_CONFIG=/etc/relay/relay.yaml

# Nothing is written outside /tmp, so the root filesystem can be read-only.
WORKDIR /tmp
USER 10001:10001

# The copied virtualenv must find its interpreter in this stage too (see the top).
RUN relay version

# The labels last: a new commit changes only this layer, and the ones above stay cached.
ARG VERSION=0.2.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=unknown

LABEL org.opencontainers.image.title="outbox-relay" \
      org.opencontainers.image.description="Relays a Postgres event table to message brokers." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0"

# /metrics, /healthz, /readyz (http.port). No HEALTHCHECK: Kubernetes uses probes.
EXPOSE 9464

ENTRYPOINT ["tini", "--", "relay"]
CMD ["run"]
