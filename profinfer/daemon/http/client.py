"""The command line's side of the daemon's HTTP endpoint (`status`, `capture`): the token a
client sends, one request to the daemon's URL, and /status as text."""
from __future__ import annotations

import errno
import os
import time

import click

from profinfer.core.base import config
from profinfer.core.base.errors import ProfinferError
from profinfer.daemon.http.tokens import TOKEN_ENV, TOKEN_MAX_BYTES

DEFAULT_TOKEN_FILE = "/run/profinfer/token"
DEFAULT_URL = "http://127.0.0.1:9464"


def token(token_file: str, required: bool) -> str | None:
    """The token a client sends: PROFINFER_TOKEN, else the token file's (None when neither is
    there and it is not required: loopback's /status needs none)."""
    token = (config.text(TOKEN_ENV) or "").strip()
    if token:
        return checked_token(token, TOKEN_ENV)
    from profinfer.core.target import procfs
    try:
        token = procfs.read_regular(token_file, TOKEN_MAX_BYTES).decode().strip()
    except OSError as e:
        if required or e.errno not in (errno.ENOENT, errno.EACCES):
            raise ProfinferError(f"cannot read the token file {token_file}: {e.strerror} "
                                 f"(or give the token in {TOKEN_ENV})") from None
        return None
    except UnicodeDecodeError:
        raise ProfinferError(f"the token file {token_file} is not text") from None
    if not token and required:
        raise ProfinferError(f"the token file {token_file} is empty")
    return checked_token(token, f"the token file {token_file}") if token else None


def checked_token(token: str, where: str) -> str:
    """A token that fits one HTTP header line (printable ASCII), else ProfinferError."""
    if not token.isascii() or not token.isprintable():
        raise ProfinferError(f"{where} holds characters a token cannot have (one line of printable ASCII)")
    return token


def request(method: str, url: str, token: str | None = None, timeout: float = 30,
                    cacert: str | None = None, insecure_http: bool = False):
    """One request to the daemon at url. The URL is parsed once, and that host is both the
    one checked and the one connected to (http.client: no proxy, no redirect followed, a
    redirect is an error); a token goes only in the Authorization header of this request, to
    whatever listens at that host and port."""
    import http.client
    import json
    import ssl
    import urllib.parse
    from profinfer.daemon.http.server import is_loopback
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise ProfinferError(f"--url {url}: {e}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ProfinferError(f"--url {url}: expected http(s)://HOST:PORT")
    if "@" in parts.netloc:
        raise ProfinferError(f"--url {url}: a user name or password in the URL is not taken; give HOST:PORT only")
    if token and parts.scheme == "http" and not is_loopback(host) and not insecure_http:
        raise ProfinferError(f"refusing to send the control token over plain HTTP to {host}: "
                             "anyone on the path could read it and attach probes with it; use https:// "
                             "(daemon --tls-cert/--tls-key, here --cacert), an SSH tunnel to 127.0.0.1, "
                             "or --insecure-http on a network you trust")
    if parts.scheme == "https":
        try:
            context = ssl.create_default_context(cafile=cacert)
        except ssl.SSLError as e:
            raise ProfinferError(f"--cacert {cacert}: not a PEM CA certificate ({e.reason or e})") from None
        except OSError as e:
            raise ProfinferError(f"cannot read --cacert {cacert}: {e.strerror}") from None
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request(method, target, headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        body = r.read()
    except ssl.SSLCertVerificationError as e:
        raise ProfinferError(f"{url}: the daemon's certificate is not trusted ({e.verify_message}): "
                             "give its CA with --cacert") from None
    except (OSError, http.client.HTTPException, ValueError) as e:   # ValueError: a port out of range
        raise ProfinferError(f"no daemon at {url}: {e or type(e).__name__}") from None
    finally:
        conn.close()
    if 300 <= r.status < 400:
        raise ProfinferError(f"{url} answered {r.status}, a redirect (to {r.getheader('Location')!r}): "
                             "not followed; give the daemon's own URL")
    if r.status >= 400:
        text = body.decode(errors="replace")
        try:
            text = json.loads(text).get("error", text)
        except (ValueError, AttributeError):
            pass
        text = " ".join(str(text).split())      # one line, whatever answered
        raise ProfinferError(f"the daemon answered {r.status}: {text[:300]}")
    return body


def show_status(url: str, token_file: str, cacert: str | None, insecure_http: bool, as_json: bool) -> None:
    """`status`: the daemon's /status, printed (as it came, with as_json)."""
    import json
    from urllib.parse import urlsplit
    from profinfer.daemon.http.server import is_loopback
    try:
        remote = not is_loopback(urlsplit(url).hostname or "")
    except ValueError:
        remote = True                 # request says what is wrong with it
    # loopback's /status needs no token: never hand it to whatever listens there (a user's
    # listener on the port while the daemon restarts)
    given = token(token_file, required=False) if remote else None
    body = request("GET", url.rstrip("/") + "/status", given, cacert=cacert, insecure_http=insecure_http)
    try:
        data = json.loads(body)
        if as_json:
            click.echo(json.dumps(data, indent=1))
            return
        print_status(data)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ProfinferError(f"{url} did not answer as a profinfer daemon does (its /status: "
                             f"{body[:80]!r})") from None


def print_status(data: dict) -> None:
    """The daemon's /status, as `status` prints it."""
    click.echo(f"daemon PID {data['pid']}, levels {','.join(data['levels'])}, budget {data['budget']:.1%}, "
               f"GPU metrics {data['gpu']}, attach errors {data['attach_errors']}")
    for p in data["processes"]:
        where = " ".join(x for x in (f"container {p['container']}" if p["container"] else "",
                                     f"pod {p['namespace']}/{p['pod']}" if p["pod_uid"] else "") if x)
        click.echo(f"  PID {p['pid']:>7} {p['comm']:<16} {p['engine']:<10} {','.join(p['levels']):<12} "
                   f"{p['probes']:>4} own probes {p['events']:>10,} events {p['lost']} lost"
                   + (f"  model {os.path.basename(p['model'])}" if p["model"] else "") + (f"  {where}" if where else ""))
    for g in data.get("shared_probes", []):
        click.echo(f"  shared by {len(g['processes'])} process(es): {g['engine']}, {g['probes']} probes on "
                   + ", ".join(g["files"]))
    flight = data.get("flight_recorder")
    if flight:
        click.echo(f"flight recorder: {'; '.join(flight['triggers'])}: {len(flight['kept'])} of "
                   f"{flight['keep']} captures kept, {flight['failed']} failed")
        for p in flight.get("processes", []):
            for t in p["triggers"]:
                click.echo(f"  PID {p['pid']:>7}  {t['trigger']}: {trigger_state(t)}")
        for c in flight["kept"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["started_at"]))
            click.echo(f"  {c['id']}  {when}  PID {c['pid']:>7}  {c['trigger']}  "
                       f"{','.join(c['levels'])}  {c['bytes']:,} bytes")


def trigger_state(t: dict) -> str:
    """A trigger's state for one process, as `status` prints it."""
    from profinfer.daemon.flight.triggers import in_unit
    if t["fired_s_ago"] is not None:
        return f"fired {t['fired_s_ago']:.0f} s ago, not re-armed yet"
    window = f"over {t.get('window_samples', '?')} samples in {t.get('window_s') or 0:.0f} s"
    baseline = f"; baseline {t['baseline_state']}" if t.get("baseline_state") else ""
    if t.get("window_state"):
        window += f" ({t['window_state']})"
    if t["value"] is None or t["limit"] is None:
        why = ["no samples in its window"] * (t["value"] is None) + ["no baseline"] * (t["limit"] is None)
        return f"not armed ({', '.join(why)}){baseline}"
    said = f"now {in_unit(t['value'], t['unit'])} {window}, limit {in_unit(t['limit'], t['unit'])}{baseline}"
    if t["holding_s"] is not None:
        return f"{said}; holding for {t['holding_s']:.1f} s"
    return said
