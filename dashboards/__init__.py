"""Grafana dashboards and Prometheus alert rules as code (see docs/OBSERVABILITY.md)."""
