"""The ingress deployment: authentication, routing and relaying. Never imports vllm, torch or serve_app.engine."""
