"""Routing: a request's model to a deployment, its affinity key, and the running replicas."""
