"""Print the gateway replica's diagnostics as JSON: ``python -m loadtests.bench.rss <gcs address>``.

A process of its own, so the benchmark process never joins a Ray cluster, and with a timeout.
Clusters that ``ray.init()`` starts use token authentication (the token in ~/.ray/auth_token), and
Ray enables token mode on connect only for ``address="auto"``, never for an explicit address: the
caller sets ``RAY_AUTH_MODE=token`` for us.
"""

from __future__ import annotations

import json
import logging
import sys

from serve_app.config import APP_NAME


def main(address: str) -> int:
    import ray
    from ray import serve

    ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        diag = serve.get_deployment_handle("gateway", app_name=APP_NAME).diagnostics.remote()
        print(json.dumps(diag.result(timeout_s=30)), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
