"""Which Redis `XLSERVE_REDIS_URL` names, and the redis-py client that talks to it.

Three deployments, told apart by the URL's scheme:

- one server: `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS) or
  `unix://...`, exactly as redis-py's `Redis.from_url` reads them (query options included);
- Redis Sentinel: `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/db]`
  (`rediss+sentinel://` for TLS). The hosts are the sentinels (port 26379 by default), the path
  names the monitored master (`sentinel monitor <service> ...`) and optionally the database. The
  credentials are the master's; sentinels that want their own are given them as the query
  options `sentinel_username` and `sentinel_password`. redis-py's `Sentinel(...).master_for()`
  asks the sentinels where the master is whenever it opens a connection, and drops connections
  to a master that was demoted, so a failover is followed without a restart;
- Redis Cluster: `redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0]`
  (`rediss+cluster://` for TLS): any nodes of the cluster (port 6379 by default) to learn the
  slot map from; a cluster has database 0 only. redis-py's `RedisCluster` routes each command to
  the node holding its key's slot and follows MOVED and ASK redirections (slots migrating,
  failovers) by itself.

TLS options for the sentinel and cluster forms: `ssl_ca_certs` (a CA bundle's path) and
`ssl_cert_reqs` (`none`, `optional`, `required`) as query options. IPv6 hosts in brackets.

Whatever the deployment, the client is set up the way the stores need it (stores.py): every call
bounded by the timeout (connecting, each reply, the wait for a pooled connection), a blocking
pool of at most `max_connections` connections (per node, in a cluster), and no retries inside
redis-py (a write retried after a timeout could land twice; redirections, which mean the node
refused the command, are still followed). The client is made on first use, so a cluster that is
down when the server starts costs what a single Redis down costs, not a failed start.

Only the standard library here, at import time: settings.py validates URLs with `parse_redis_url`
in the API process, which never loads the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

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
    if scheme in SINGLE_SCHEMES:
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


def _shown(url: str) -> str:
    """`url` cut before any credentials, for an error message."""
    return url.split("@", 1)[-1] if "@" in url else url


def _tls_kwargs(target: RedisTarget) -> dict:
    if not target.tls:
        return {}
    kwargs: dict = {"ssl": True}
    if "ssl_ca_certs" in target.tls_options:
        kwargs["ssl_ca_certs"] = target.tls_options["ssl_ca_certs"]
    if "ssl_cert_reqs" in target.tls_options:
        kwargs["ssl_cert_reqs"] = target.tls_options["ssl_cert_reqs"]
    return kwargs


def connect(url: str, timeout_s: float, max_connections: int):
    """(client, close) for `url`: a redis-py client (Redis, or RedisCluster for a cluster) and a
    function that closes it and every connection it opened. Nothing is connected yet, except
    that a RedisCluster reads the slot map when made (so make it on first use)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    target = parse_redis_url(url)
    bounded = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if target.mode == "single":
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, retry=Retry(NoBackoff(), 0), **bounded)
        client = redis.Redis(connection_pool=pool)

        def close_single() -> None:
            client.close()
            pool.disconnect()

        return client, close_single

    credentials = {"username": target.username, "password": target.password}
    if target.mode == "sentinel":
        from redis.sentinel import Sentinel, SentinelConnectionPool

        class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
            """The master's connections, found through the sentinels, from a blocking pool (a
            caller waits up to the timeout for a free connection instead of failing at once)."""

        sentinel_kwargs = {**bounded, "retry": Retry(NoBackoff(), 0), **_tls_kwargs(target)}
        if target.sentinel_password is not None:
            sentinel_kwargs.update(username=target.sentinel_username, password=target.sentinel_password)
        sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
        client = sentinel.master_for(
            target.service, connection_pool_class=BlockingSentinelPool, db=target.db, max_connections=max_connections,
            timeout=timeout_s, retry=Retry(NoBackoff(), 0), **bounded, **credentials, **_tls_kwargs(target))

        def close_sentinel() -> None:
            client.close()
            client.connection_pool.disconnect()
            sentinel.close()

        return client, close_sentinel

    from redis.cluster import ClusterNode, RedisCluster

    # A blocking pool per node: RedisCluster uses `connection_pool_class` for the nodes only when
    # it is given a URL, so the first node goes in as one (without credentials: they are passed
    # as arguments) and the others as startup nodes.
    (first_host, first_port), *others = target.nodes
    first = f"{'rediss' if target.tls else 'redis'}://{_url_host(first_host)}:{first_port}/0"
    client = RedisCluster(
        url=first, startup_nodes=[ClusterNode(host, port) for host, port in others],
        connection_pool_class=redis.BlockingConnectionPool, max_connections=max_connections, timeout=timeout_s,
        retry=Retry(NoBackoff(), 0), **bounded, **credentials, **target.tls_options)  # rediss:// picks TLS
    return client, client.close


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
