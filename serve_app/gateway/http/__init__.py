"""HTTP: the routes (model API, admin API), request bodies, the proxy's middleware."""
