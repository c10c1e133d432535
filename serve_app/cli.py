"""Console entry point ``serve-app``: run the embedded default, manage keys, build the tiny model,
check config files, print a model's vLLM engine arguments and diagnose a running deployment."""

from __future__ import annotations

import argparse
import os
import sys

from serve_app.local import front_door

DEFAULT_CONFIG = "configs/local.yaml"
LIMIT_OPTIONS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap")

# Each command parses nothing more and imports its module only when it runs, so that a quick
# command (`serve-app keys create`) does not load what `serve-app run` needs.


def cmd_run(ns: argparse.Namespace) -> int:
    from serve_app.local.stack import LocalStack
    from serve_app.ops.configfile import load_config, serve_doc

    doc = serve_doc(ns.config)
    stack = LocalStack.from_config(load_config(ns.config), doc.get("http_options"), host=ns.host,
                                   port=ns.port, keys_file=ns.keys_file, ingress=ns.ingress,
                                   verbose=ns.verbose)
    return stack.run(ns.timeout, ns.ready_file, ns.prometheus)


def cmd_keys(ns: argparse.Namespace) -> int:
    from serve_app.ops import keys
    from serve_app.state.keys import KeysFileError

    limits = {name: value for name in LIMIT_OPTIONS if (value := getattr(ns, name, None)) is not None}
    extra: dict[str, object] = {}
    if getattr(ns, "role", None):
        extra["role"] = ns.role
    if getattr(ns, "expires_at", None):
        extra["expires_at"] = ns.expires_at
    if getattr(ns, "budget_tokens", None):
        extra["budget"] = {"tokens": ns.budget_tokens, "period": ns.budget_period}
    try:
        gw = keys.gateway_config(ns.keys_file, ns.config)
    except KeysFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return keys.run(ns.keys_cmd, gw, getattr(ns, "id", ""),
                    tier=getattr(ns, "tier", "standard"), models=getattr(ns, "models", "*"),
                    tenant=getattr(ns, "tenant", None), limits=limits, **extra)


def cmd_build_tiny_model(ns: argparse.Namespace) -> int:
    from serve_app.local.tiny_model import ensure_tiny_model

    ensure_tiny_model(ns.cache_dir, force=ns.force)
    return 0


def cmd_build_tiny_lora(ns: argparse.Namespace) -> int:
    """``count`` tiny LoRAs for tiny-chat (seeds ``seed``, ``seed + 1`` ...) into ``out/lora-NN``;
    each folder's path on a line. The builtin adapter is the default seed's; other seeds make other
    adapters of the same recipe (``make bench-lora`` builds 16)."""
    from pathlib import Path

    from serve_app.engine.tiny_lora import build_tiny_lora

    out = Path(ns.out).expanduser()
    for i in range(ns.count):
        print(build_tiny_lora(out / f"lora-{i:02d}", seed=ns.seed + i, force=ns.force), flush=True)
    return 0


def cmd_engine_args(ns: argparse.Namespace) -> int:
    from serve_app.ops.configfile import engine_args

    return engine_args(ns.config, ns.model)


def cmd_sim_engine(ns: argparse.Namespace) -> int:
    from serve_app.engine.sim.http import serve, standalone_model
    from serve_app.ops.configfile import load_config

    cfg = load_config(ns.config)
    try:
        model = cfg.model(ns.model)
    except KeyError:
        print(f"error: {ns.config}: no model {ns.model!r} (have {[m.id for m in cfg.models]})",
              file=sys.stderr)
        return 2
    engine = {k: v for k, v in (("block_size", ns.block_size),
                                ("max_num_batched_tokens", ns.max_num_batched_tokens)) if v}
    return serve(standalone_model(model, ns.profile, time_scale=ns.time_scale,
                                  num_blocks=ns.num_blocks, engine=engine), ns.host, ns.port)


def cmd_check_config(ns: argparse.Namespace) -> int:
    from serve_app.ops.configfile import check_config

    return check_config(ns.files)


def cmd_dashboards(ns: argparse.Namespace) -> int:
    from serve_app.ops.grafana_push import push_command

    return push_command(ns.url, ns.token, ns.folder, ns.dir)


def cmd_diagnose(ns: argparse.Namespace) -> int:
    from serve_app.ops import diagnose

    return diagnose.run()


def cmd_doctor(ns: argparse.Namespace) -> int:
    from serve_app.ops import doctor

    return doctor.main(ns.base_url, ns.api_key)


# ---- arguments ----------------------------------------------------------------------------------
def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("run", help="run a config locally (the embedded default by default)")
    run.add_argument("--config", default=DEFAULT_CONFIG)
    run.add_argument("--host")
    run.add_argument("--port", type=int)
    run.add_argument("--keys-file", help="override the config's gateway.keys.file")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for readiness")
    run.add_argument("--ready-file", help="write a JSON file here once ready (for scripts)")
    run.add_argument("--verbose", action="store_true", help="stream replica logs to this terminal")
    run.add_argument("--ingress", choices=front_door.MODES,
                     default=os.environ.get("SERVE_APP_INGRESS", "haproxy"),
                     help="HTTP front door: HAProxy with the gateway replicas serving HTTP directly "
                          "(default, fastest), or Ray Serve's Python proxy actor "
                          "(default from SERVE_APP_INGRESS)")
    run.add_argument("--prometheus", action="store_true",
                     help="also start a Prometheus on 127.0.0.1 that scrapes Ray's metrics export "
                          "(needs Debian's prometheus package) and print its URL")
    run.set_defaults(func=cmd_run)


def _add_dashboards(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = sub.add_parser("dashboards", help="upload the generated Grafana dashboards")
    dsub = db.add_subparsers(dest="dashboards_cmd", required=True)
    dp = dsub.add_parser("push", help="create or overwrite the dashboards on a Grafana server")
    dp.add_argument("--url", required=True, help="Grafana base URL, e.g. http://127.0.0.1:3000")
    dp.add_argument("--token", help="service-account token (default: $GRAFANA_TOKEN)")
    dp.add_argument("--folder", default="serve-app", help="Grafana folder (created if missing)")
    dp.add_argument("--dir", help="folder of dashboard JSON (default: the packaged ones, "
                                  "serve_app/ops/dashboards)")
    db.set_defaults(func=cmd_dashboards)


def _add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="create, list, rotate and revoke API keys")
    keys.add_argument("--config", default=DEFAULT_CONFIG)
    keys.add_argument("--keys-file", help="defaults to the config's gateway.keys.file")
    # The same two options after the subcommand too (`keys create --keys-file F ...`).
    key_opts = argparse.ArgumentParser(add_help=False)
    key_opts.add_argument("--config", default=argparse.SUPPRESS)
    key_opts.add_argument("--keys-file", default=argparse.SUPPRESS)
    ksub = keys.add_subparsers(dest="keys_cmd", required=True)
    kc = ksub.add_parser("create", parents=[key_opts], help="create a key and print its secret once")
    kc.add_argument("--id", required=True)
    kc.add_argument("--tier", default="standard")
    kc.add_argument("--models", default="*", help="comma-separated model ids or aliases, or *")
    kc.add_argument("--tenant", help="keys of one tenant share the prefix cache (default: the key id)")
    for name in LIMIT_OPTIONS:
        kc.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int,
                        help=f"override the tier's per-key {name}")
    kc.add_argument("--role", choices=("client", "admin"),
                    help="admin keys use only the admin API (/admin/v1); default client")
    kc.add_argument("--expires-at", help="ISO 8601 time after which the key gets 401")
    kc.add_argument("--budget-tokens", type=int, help="tokens the key may use per --budget-period")
    kc.add_argument("--budget-period", choices=("day", "month"), default="month")
    ksub.add_parser("list", parents=[key_opts], help="list keys (never secrets)")
    kro = ksub.add_parser("rotate", parents=[key_opts],
                          help="replace a key's secret; the old one stops working")
    kro.add_argument("--id", required=True)
    kr = ksub.add_parser("revoke", parents=[key_opts], help="revoke a key")
    kr.add_argument("--id", required=True)
    keys.set_defaults(func=cmd_keys)


def _add_model_tools(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bt = sub.add_parser("build-tiny-model", help="build the tiny chat model into the cache")
    bt.add_argument("--cache-dir", default="~/.cache/serve-app")
    bt.add_argument("--force", action="store_true")
    bt.set_defaults(func=cmd_build_tiny_model)

    bl = sub.add_parser("build-tiny-lora", help="build tiny LoRA adapters for tiny-chat into a folder "
                                               "(seeded, no download; one per seed)")
    bl.add_argument("--out", required=True, help="folder; adapter i goes to <out>/lora-<i, 2 digits>")
    bl.add_argument("--count", type=int, default=1)
    bl.add_argument("--seed", type=int, default=4321, help="the first adapter's seed (4321: the builtin's)")
    bl.add_argument("--force", action="store_true")
    bl.set_defaults(func=cmd_build_tiny_lora)

    ea = sub.add_parser("engine-args", help="print the vLLM engine arguments of one model as JSON "
                                            "(model_path, engine_kwargs, frontend, env)")
    ea.add_argument("--config", default=DEFAULT_CONFIG)
    ea.add_argument("--model", required=True, help="model id in the config")
    ea.set_defaults(func=cmd_engine_args)

    se = sub.add_parser("sim-engine", help="serve one model's SIMULATED engine on its own (OpenAI "
                                           "completions and chat, no gateway), to compare it with "
                                           "plain vLLM")
    se.add_argument("--config", default=DEFAULT_CONFIG)
    se.add_argument("--model", required=True, help="model id in the config (its engine arguments)")
    se.add_argument("--profile", required=True, help="step-time profile (serve_app/engine/sim/profiles.json)")
    se.add_argument("--time-scale", type=float, default=1.0)
    se.add_argument("--num-blocks", type=int, help="KV cache blocks (default: the schema's)")
    se.add_argument("--block-size", type=int, help="tokens per KV block, if the config sets none")
    se.add_argument("--max-num-batched-tokens", type=int, help="step token budget, if the config sets none")
    se.add_argument("--host", default="127.0.0.1")
    se.add_argument("--port", type=int, default=8100)
    se.set_defaults(func=cmd_sim_engine)

    cc = sub.add_parser("check-config", help="validate Ray Serve config files against the schema")
    cc.add_argument("files", nargs="+")
    cc.set_defaults(func=cmd_check_config)


def _add_checks(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dg = sub.add_parser("diagnose", help="status of the running app and its gateway replica")
    dg.set_defaults(func=cmd_diagnose)

    dr = sub.add_parser("doctor", help="check a running gateway as a client sees it, and name fixes")
    dr.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                    help="the gateway's base URL, with /v1 (default: OPENAI_BASE_URL)")
    dr.add_argument("--api-key", help="the key to check (default: OPENAI_API_KEY)")
    dr.set_defaults(func=cmd_doctor)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve-app", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (_add_run, _add_dashboards, _add_keys, _add_model_tools, _add_checks):
        add(sub)
    ns = p.parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
