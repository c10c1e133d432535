"""Load tests and benchmarks. They treat the service as a black box over HTTP (loopback only)."""
