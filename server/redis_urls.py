"""Redis URLs: which deployment `XLSERVE_REDIS_URL` names, and how to show one without its secrets.

Shared by the settings (server/settings.py validates the URL when it is read, in the API process)
and the session cache (server/cache/: redis_client.py connects to what `parse_redis_url` names,
stores.py names the server in its errors with `masked_url`). Neither layer owns the other, so this
module belongs to neither: the standard library only, so that the API process never loads redis-py
or torch for it.

Three deployments, told apart by the URL's scheme:

- one server: `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS) or
  `unix://...`, exactly as redis-py's `Redis.from_url` reads them (query options included);
- Redis Sentinel: `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/db]`
  (`rediss+sentinel://` for TLS). The hosts are the sentinels (port 26379 by default), the path
  names the monitored master (`sentinel monitor <service> ...`) and optionally the database. The
  credentials are the master's; sentinels that want their own are given them as the query
  options `sentinel_username` and `sentinel_password`;
- Redis Cluster: `redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0]`
  (`rediss+cluster://` for TLS): any nodes of the cluster (port 6379 by default) to learn the
  slot map from; a cluster has database 0 only.

TLS options for the sentinel and cluster forms: `ssl_ca_certs` (a CA bundle's path) and
`ssl_cert_reqs` (`none`, `optional`, `required`) as query options. IPv6 hosts in brackets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

SINGLE_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_PORT = 26379
CLUSTER_PORT = 6379
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_cert_reqs")
_CERT_REQS = ("none", "optional", "required")


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names. `nodes` are the sentinels (sentinel) or the startup nodes (cluster);
    for a single server everything is left to redis-py's own URL parser."""

    mode: Literal["single", "sentinel", "cluster"]
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None  # sentinel: the monitored master's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    tls_options: dict = field(default_factory=dict)


def parse_redis_url(url: str) -> RedisTarget:
    """The deployment `url` names; ValueError, saying what is wrong, when it names none."""
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if not rest:
        raise ValueError(f"not a Redis URL (no scheme://): {_shown(url)!r}")
    if scheme != "unix" and _credentials_cut_short(rest):
        # what an error would quote of the host part is the start of the password
        raise ValueError(f"this {scheme}:// URL has an '@' after its host part: either its username or password "
                         "holds a '/', '?' or '#', which end the host part early (redis-py would take it apart the "
                         "same way), or its path does (a service name): percent-encode those characters (%2F, %3F, "
                         "%23; an '@' as %40)")
    if scheme in SINGLE_SCHEMES:
        if scheme != "unix":  # what redis-py would ignore or take wrongly: its parser drops a bad database
            netloc, _, path = rest.split("?", 1)[0].split("#", 1)[0].partition("/")
            _node(netloc.rpartition("@")[2], CLUSTER_PORT)  # host[:port]
            segments = [segment for segment in path.split("/") if segment]
            if len(segments) > 1:
                raise ValueError(f"a {scheme}:// URL names one database: {scheme}://host[:port][/db]")
            if segments:
                _db(unquote(segments[0]))
        return RedisTarget("single", url)
    if scheme not in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
        known = ", ".join(s + "://" for s in SINGLE_SCHEMES + SENTINEL_SCHEMES + CLUSTER_SCHEMES)
        raise ValueError(f"unknown Redis URL scheme {scheme + '://'!r} (known: {known})")
    sentinel = scheme in SENTINEL_SCHEMES
    parts = urlsplit("x://" + rest)  # only path, query and fragment; the netloc is taken apart below
    if parts.fragment:
        raise ValueError("a Redis URL has no #fragment")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = tuple(_node(host, SENTINEL_PORT if sentinel else CLUSTER_PORT) for host in hosts.split(","))
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    allowed = _TLS_OPTIONS + (("sentinel_username", "sentinel_password") if sentinel else ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} in a {scheme}:// URL (known: {', '.join(allowed)})")
    if options.get("ssl_cert_reqs", "required") not in _CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
    tls = scheme.startswith("rediss")
    tls_options = {k: options[k] for k in _TLS_OPTIONS if k in options}
    if tls_options and not tls:
        raise ValueError(f"TLS options need the rediss{scheme[5:]}:// scheme")
    path = [segment for segment in parts.path.split("/") if segment]
    if sentinel:
        if not path or len(path) > 2:
            raise ValueError("a Sentinel URL names the master's service: redis+sentinel://host:26379[,host:26379...]"
                             "/<service>[/db]")
        service, db = unquote(path[0]), _db(path[1] if len(path) == 2 else "0")
        return RedisTarget("sentinel", url, nodes, service, db, username, password,
                           options.get("sentinel_username") or None, options.get("sentinel_password") or None,
                           tls, tls_options)
    if len(path) > 1 or (path and _db(path[0]) != 0):
        raise ValueError("a Redis Cluster has database 0 only: redis+cluster://host:6379[,host:6379...][/0]")
    return RedisTarget("cluster", url, nodes, None, 0, username, password, None, None, tls, tls_options)


def _node(text: str, default_port: int) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, after = text[1:].partition("]")
        port = after[1:] if after.startswith(":") else ("" if not after else None)
    elif text.count(":") > 1:
        raise ValueError(f"an IPv6 address goes in brackets: [{text}]")
    else:
        host, _, port = text.partition(":")
    if not host or port is None:
        raise ValueError(f"not a host[:port]: {text!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"not a port: {port!r} (in {text!r})")
    return host, int(port) if port else default_port


def _db(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"not a database number: {text!r}")
    return int(text)


def _credentials_cut_short(rest: str) -> bool:
    """Whether a URL's `rest` (after scheme://) has credentials that a '/', '?' or '#' in them cut
    off from their '@': an '@' after the host part, before any query option's '=' (a
    `sentinel_password=` value may hold one)."""
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    after = rest[len(authority):]
    at, equals = after.find("@"), after.find("=")
    return "@" not in authority and at >= 0 and (equals < 0 or at < equals)


def _shown(url: str) -> str:
    """`url` cut before any credentials, for an error message."""
    return url.split("@", 1)[-1] if "@" in url else url


def masked_url(url: str) -> str:
    """`url` with its password (if any) replaced by ***, for logs and error messages: a Redis URL
    may carry one (redis://user:password@host:port/db), a Sentinel URL also the sentinels' (the
    `sentinel_password` query option), and the multi-host forms list several hosts."""
    url = re.sub(r"([?&](?:[a-z_]*_)?password=)[^&#]*", r"\1***", url)  # ?password=, ?sentinel_password=
    scheme, separator, rest = url.partition("://")
    if separator and _credentials_cut_short(rest):  # a password holding '/', '?' or '#': hide all before the '@'
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    if "+" in scheme and separator:  # redis+sentinel://, redis+cluster://: host,host,... (parse_redis_url below)
        netloc, slash, tail = rest.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        if at and ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        return f"{scheme}://{userinfo}{at}{hosts}{slash}{tail}"
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 address goes back into brackets
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port is not None else ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
    except ValueError:  # not a URL urllib can take apart (a bad port): hide all the credentials
        return re.sub(r"//[^/]*@", "//***@", url)
