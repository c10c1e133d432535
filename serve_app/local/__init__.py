"""The embedded default's launcher: demo key, local Redis, tiny model, Ray, front door, Prometheus."""
