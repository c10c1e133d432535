"""The ingress: authentication, routing and relaying. Never imports vllm, torch or serve_app.engine."""
