#!/usr/bin/env bash
# What the tests need besides Python packages, on a fresh machine (run as root, as the
# README's test command does): PostgreSQL on 127.0.0.1:5432 and Redis on 127.0.0.1:6379,
# started if they are down, and the Prometheus server and promtool from Debian's
# `prometheus` package, installed if missing (the monitoring tests start their own).
set -euo pipefail

if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    echo "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    echo "starting Redis"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
for _ in $(seq 30); do
    pg_isready -q -h 127.0.0.1 -p 5432 && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break
    sleep 1
done

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "installing Prometheus (Debian's package)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
