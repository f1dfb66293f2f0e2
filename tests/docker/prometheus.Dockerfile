# Test only (tests/serving/test_image.py): Prometheus from Debian's package, on the same Debian-based python image
# the proxy's Dockerfile starts from, so it builds wherever that image does (no Docker Hub pull of
# prom/prometheus needed). Run with --network host and a config mounted at /etc/prometheus/prometheus.yml.
FROM python:3.12-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/*
USER nobody
ENTRYPOINT ["/usr/bin/prometheus", "--config.file=/etc/prometheus/prometheus.yml", \
            "--storage.tsdb.path=/tmp/prometheus"]
