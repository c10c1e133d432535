"""The console's HTML: server-rendered, no script, no CDN; every value from a key, a batch, the
audit log or a form passes through ``_e`` (``html.escape``) before it reaches the page.

Each function returns one page's HTML; ``console.py`` decides which and with what, and sends it
with ``respond`` (the console's security headers) or ``refused``."""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from starlette.responses import HTMLResponse

from serve_app.config import KeyRecord

HEADERS = {  # no framing, no caching of pages that show secrets, nothing loaded from elsewhere
    "Cache-Control": "no-store", "X-Frame-Options": "DENY", "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
}
NAV = (("keys", "Keys"), ("usage", "Usage"), ("sla", "SLA"), ("replicas", "Replicas"),
       ("batches", "Batches"), ("audit", "Audit log"))
CSS = """
body{font:15px/1.45 system-ui,sans-serif;margin:0;color:#1b1b1b;background:#fafafa}
header{background:#1f3a5f;color:#fff;padding:.6rem 1.5rem;display:flex;gap:1.5rem;align-items:center}
header a{color:#fff}header a[aria-current]{font-weight:700;text-decoration:none}
header form{margin-left:auto}main{max-width:1240px;margin:0 auto;padding:1rem 1.5rem}
table{border-collapse:collapse;width:100%;margin:.5rem 0 1.5rem;background:#fff}
th,td{border:1px solid #ccd;padding:.3rem .5rem;text-align:left;vertical-align:top}
th{background:#e8edf3}fieldset{border:1px solid #ccd;background:#fff;margin:0 0 1rem}
label{display:inline-block;min-width:9rem}.row{margin:.35rem 0}
input,select,button{font:inherit;padding:.2rem .4rem}
button:focus,input:focus,select:focus,a:focus{outline:3px solid #f0b400}
.error{border-left:5px solid #b00020;background:#fdecee;padding:.5rem 1rem}
.notice{border-left:5px solid #1b7f3a;background:#e9f6ec;padding:.5rem 1rem}
.secret{font:1.05rem monospace;background:#fff;border:1px dashed #555;padding:.4rem;word-break:break-all}
.bad{color:#b00020;font-weight:700}.good{color:#1b7f3a;font-weight:700}
td form{display:inline;margin:0 .2rem 0 0}code{word-break:break-all}
"""


def _e(value: Any) -> str:
    """Any value as escaped text (None as an empty cell)."""
    return "" if value is None else html.escape(str(value), quote=True)


def _csrf_field(csrf: str) -> str:
    return f'<input type="hidden" name="csrf" value="{_e(csrf)}">'


def page(title: str, body: str, *, active: str | None = None, csrf: str | None = None,
         who: str | None = None) -> str:
    """The whole document: header with the navigation (when signed in), then ``body``."""
    nav = ""
    if who is not None and csrf is not None:
        current = ' aria-current="page"'
        links = " ".join(f'<a href="/console/{slug}"{current if slug == active else ""}>{label}</a>'
                         for slug, label in NAV)
        nav = (f'<nav aria-label="Console">{links}</nav>'
               f'<form method="post" action="/console/signout">{_csrf_field(csrf)}'
               f'<span>Signed in as <strong>{_e(who)}</strong></span> '
               '<button type="submit">Sign out</button></form>')
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_e(title)} - serve-app console</title><style>{CSS}</style></head><body>"
            f"<header><strong>serve-app console</strong>{nav}</header>"
            f"<main><h1>{_e(title)}</h1>{body}</main></body></html>")


def messages(error: str | None = None, notice: str | None = None) -> str:
    out = ""
    if error:
        out += f'<p class="error" role="alert">{_e(error)}</p>'
    if notice:
        out += f'<p class="notice" role="status">{_e(notice)}</p>'
    return out


def signin(error: str | None = None) -> str:
    body = (messages(error) +
            '<form method="post" action="/console/signin">'
            '<div class="row"><label for="key">Admin key</label> '
            '<input id="key" name="key" type="password" autocomplete="off" required size="60"></div>'
            '<div class="row"><button type="submit">Sign in</button></div></form>'
            "<p>Only keys with <code>role: admin</code> may sign in; the session ends after "
            "<code>gateway.console.session_ttl_s</code>, or at once when the key is revoked, "
            "expires or is rotated.</p>")
    return page("Sign in", body)


def _text(name: str, label: str, value: str = "", hint: str = "", required: bool = False) -> str:
    req = " required" if required else ""
    return (f'<div class="row"><label for="{name}">{label}</label> '
            f'<input id="{name}" name="{name}" value="{_e(value)}"{req}> <small>{_e(hint)}</small></div>')


def _select(name: str, label: str, options: Iterable[str], chosen: str = "") -> str:
    opts = "".join(f'<option value="{_e(o)}"{" selected" if o == chosen else ""}>{_e(o) or "(default)"}</option>'
                   for o in options)
    return f'<div class="row"><label for="{name}">{label}</label> <select id="{name}" name="{name}">{opts}</select></div>'


def _key_row(k: KeyRecord, csrf: str) -> str:
    budget = f"{k.budget.tokens} / {k.budget.period}" if k.budget else ""
    status = '<span class="bad">revoked</span>' if k.revoked else "active"
    actions = ""
    if not k.revoked:
        for verb in ("rotate", "revoke"):
            actions += (f'<form method="post" action="/console/keys/{_e(k.id)}/{verb}">'
                        f'{_csrf_field(csrf)}<button type="submit" '
                        f'aria-label="{verb.capitalize()} key {_e(k.id)}">{verb.capitalize()}</button></form>')
    return (f'<tr><th scope="row">{_e(k.id)}</th><td>{_e(k.role)}</td><td>{_e(k.tier)}</td>'
            f'<td>{_e(k.tenant)}</td><td>{_e(", ".join(k.models))}</td><td>{_e(budget)}</td>'
            f'<td>{_e(k.expires_at)}</td><td>{_e(k.created_at)}</td><td>{status}</td><td>{actions}</td></tr>')


def keys(records: Sequence[KeyRecord], tiers: Iterable[str], csrf: str, who: str, *,
         error: str | None = None, notice: str | None = None, secret: tuple[str, str] | None = None,
         form: Mapping[str, str] | None = None) -> str:
    """The key list, a create form and each key's rotate and revoke; ``secret`` (key id, secret)
    is shown once, after a create or rotate."""
    f = dict(form or {})
    shown = ""
    if secret is not None:
        shown = (f'<section aria-labelledby="secret-h"><h2 id="secret-h">Secret of key {_e(secret[0])}</h2>'
                 '<p>Copy it now: it is shown this once, and stored only as a digest.</p>'
                 f'<p class="secret" id="new-secret">{_e(secret[1])}</p></section>')
    rows = "".join(_key_row(k, csrf) for k in records)
    cols = ("Id", "Role", "Tier", "Tenant", "Models", "Budget", "Expires", "Created", "Status", "Actions")
    head = "".join(f'<th scope="col">{c}</th>' for c in cols)
    create = (
        '<form method="post" action="/console/keys"><fieldset><legend>Create a key</legend>'
        + _csrf_field(csrf)
        + _text("id", "Id", f.get("id", ""), "letters, digits, . _ -", required=True)
        + _select("role", "Role", ("client", "admin"), f.get("role", "client"))
        + _select("tier", "Tier", ("", *tiers), f.get("tier", ""))
        + _text("models", "Models", f.get("models", ""), "comma-separated; empty: every model")
        + _text("tenant", "Tenant", f.get("tenant", ""))
        + _text("budget_tokens", "Budget (tokens)", f.get("budget_tokens", ""), "empty: none")
        + _select("budget_period", "Budget period", ("month", "day"), f.get("budget_period", "month"))
        + _text("expires_at", "Expires at", f.get("expires_at", ""), "ISO 8601, e.g. 2030-01-01T00:00:00Z")
        + '<div class="row"><button type="submit">Create key</button></div></fieldset></form>')
    body = (messages(error, notice) + shown +
            f'<h2>Keys</h2><table><caption>{len(records)} keys</caption><thead><tr>{head}</tr></thead>'
            f'<tbody>{rows}</tbody></table>' + create)
    return page("Keys", body, active="keys", csrf=csrf, who=who)


def usage(report: Mapping[str, Any] | None, filters: Mapping[str, str], csrf: str, who: str,
          error: str | None = None) -> str:
    """Requests and tokens by key, as ``GET /admin/v1/usage`` answers, with its filters."""
    form = ('<form method="get" action="/console/usage"><fieldset><legend>Filter</legend>'
            + _text("key_id", "Key id", filters.get("key_id", ""))
            + _text("tenant", "Tenant", filters.get("tenant", ""))
            + _text("model", "Model", filters.get("model", ""))
            + _text("period", "Period", filters.get("period", ""), "YYYY-MM or YYYY-MM-DD (UTC)")
            + '<div class="row"><button type="submit">Show</button></div></fieldset></form>')
    table = ""
    if report is not None:
        fields = ("requests", "prompt_tokens", "completion_tokens")
        head = '<th scope="col">Key</th>' + "".join(f'<th scope="col">{_e(f)}</th>' for f in fields)
        rows = "".join(f'<tr><th scope="row">{_e(k)}</th>' + "".join(f"<td>{_e(v.get(f))}</td>" for f in fields)
                       + "</tr>" for k, v in report["by_key"].items())
        total = '<tr><th scope="row">Total</th>' + "".join(f"<td>{_e(report.get(f))}</td>" for f in fields) + "</tr>"
        table = f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody><tfoot>{total}</tfoot></table>"
    return page("Usage", messages(error) + form + table, active="usage", csrf=csrf, who=who)


def sla(rows: Sequence[Mapping[str, Any]], note: str | None, csrf: str, who: str) -> str:
    """Each tier's objectives, its TTFT p95 from Prometheus when known, and the SLO misses counted."""
    cols = ("Tier", "TTFT p95 objective", "TTFT p95 (5 min)", "Verdict", "TPOT p95 objective",
            "Requests", "TTFT misses", "TPOT misses")
    head = "".join(f'<th scope="col">{c}</th>' for c in cols)
    body_rows = ""
    for r in rows:
        p95 = r.get("ttft_p95_ms")
        verdict = ("" if p95 is None else '<span class="good">meets</span>'
                   if p95 <= r["ttft_objective_ms"] else '<span class="bad">misses</span>')
        body_rows += (f'<tr><th scope="row">{_e(r["tier"])}</th><td>{_e(r["ttft_objective_ms"])} ms</td>'
                      f'<td>{"n/a" if p95 is None else _e(f"{p95:.0f} ms")}</td><td>{verdict}</td>'
                      f'<td>{_e(r["tpot_objective_ms"])} ms</td><td>{_e(r["requests"])}</td>'
                      f'<td>{_e(r["ttft_misses"])}</td><td>{_e(r["tpot_misses"])}</td></tr>')
    body = (messages(notice=note) + f"<table><thead><tr>{head}</tr></thead><tbody>{body_rows}</tbody></table>"
            "<p>Requests and misses: all-time totals of the keys of each tier, from the usage store "
            "(the same counts as <code>GET /v1/usage</code>).</p>")
    return page("SLA", body, active="sla", csrf=csrf, who=who)


def replicas(rows: Sequence[Mapping[str, Any]], note: str | None, csrf: str, who: str) -> str:
    """Each model's replicas: endpoint, engine load, KV cache, prefix-cache hit rate, adapters."""
    cols = ("Model", "Replica", "Endpoint", "Running", "Waiting", "KV cache", "Prefix-cache hits (5 min)",
            "Adapters running", "Adapters configured")
    head = "".join(f'<th scope="col">{c}</th>' for c in cols)

    def num(v: Any, fmt: str) -> str:
        return "n/a" if v is None else _e(format(v, fmt))

    body_rows = ""
    for r in rows:
        running = r.get("adapters")
        body_rows += (f'<tr><th scope="row">{_e(r["model"])}</th>'
                      f'<td>{_e(r["replica"] or "none running")}</td><td>{_e(r["endpoint"] or "")}</td>'
                      f'<td>{num(r.get("running"), ".0f")}</td><td>{num(r.get("waiting"), ".0f")}</td>'
                      f'<td>{num(r.get("kv_cache"), ".1%")}</td><td>{num(r.get("hit_rate"), ".1%")}</td>'
                      f'<td>{"n/a" if running is None else _e(", ".join(running) or "none")}</td>'
                      f'<td>{_e(", ".join(r["adapters_configured"]) or "none")}</td></tr>')
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{body_rows}</tbody></table>"
    return page("Replicas", messages(notice=note) + table, active="replicas", csrf=csrf, who=who)


def batches(docs: Sequence[Mapping[str, Any]], note: str | None, csrf: str, who: str) -> str:
    """Every tenant's latest batches: status, progress, errors."""
    cols = ("Id", "Tenant", "Key", "Endpoint", "Status", "Progress", "Failed", "Created", "Errors")
    head = "".join(f'<th scope="col">{c}</th>' for c in cols)
    rows = ""
    for b in docs:
        errs = "; ".join(str(x.get("message", x)) for x in (b.get("errors") or [])[:3])
        rows += (f'<tr><th scope="row">{_e(b.get("id"))}</th><td>{_e(b.get("owner"))}</td>'
                 f'<td>{_e(b.get("key_id"))}</td><td>{_e(b.get("endpoint"))}</td>'
                 f'<td>{_e(b.get("status"))}</td><td>{_e(b.get("completed"))} / {_e(b.get("total"))}</td>'
                 f'<td>{_e(b.get("failed"))}</td><td>{_e(b.get("created_at"))}</td><td>{_e(errs)}</td></tr>')
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>" if docs else "<p>No batches.</p>"
    return page("Batches", messages(notice=note) + table, active="batches", csrf=csrf, who=who)


def audit(lines: Sequence[Mapping[str, Any]], note: str | None, csrf: str, who: str) -> str:
    """The audit log's last lines, newest first."""
    cols = ("Time", "Actor", "Action", "Target", "Result", "Detail")
    head = "".join(f'<th scope="col">{c}</th>' for c in cols)
    rows = ""
    for line in lines:
        rest = {k: v for k, v in line.items() if k not in ("time", "actor", "action", "target", "result")}
        rows += (f'<tr><th scope="row">{_e(line.get("time"))}</th><td>{_e(line.get("actor"))}</td>'
                 f'<td>{_e(line.get("action"))}</td><td>{_e(line.get("target"))}</td>'
                 f'<td>{_e(line.get("result"))}</td><td><code>{_e(json.dumps(rest) if rest else "")}</code></td></tr>')
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>" if lines else ""
    return page("Audit log", messages(notice=note) + table, active="audit", csrf=csrf, who=who)


def failure(title: str, message: str) -> str:
    """A refusal or an error, as a page (never a traceback)."""
    return page(title, messages(message) + '<p><a href="/console/keys">Back to the console</a></p>')


def respond(body: str, status: int = 200) -> HTMLResponse:
    """A page as a response, with the console's security headers."""
    return HTMLResponse(body, status_code=status, headers=HEADERS)


def refused(status: int, message: str) -> HTMLResponse:
    return respond(failure("Refused", message), status)


def no_secret() -> HTMLResponse:
    return refused(503, "The console has no shared session secret: set gateway.console.secret, "
                        "gateway.state.redis_url or gateway.state.dir.")
