"""The redis-py client that talks to the Redis deployment `XLSERVE_REDIS_URL` names.

Which deployment a URL names, and the URL forms, are server/redis_urls.py's (`parse_redis_url`,
standard library only, shared with the settings). Here each deployment gets redis-py's own client:

- one server (`redis://`, `rediss://`, `unix://`): `Redis` over a blocking pool made by
  `BlockingConnectionPool.from_url`, which reads the URL itself (query options included);
- Redis Sentinel (`redis+sentinel://`): redis-py's `Sentinel(...).master_for()` asks the
  sentinels where the master is whenever it opens a connection, and drops connections to a master
  that was demoted, so a failover is followed without a restart;
- Redis Cluster (`redis+cluster://`): redis-py's `RedisCluster` routes each command to the node
  holding its key's slot and follows MOVED and ASK redirections (slots migrating, failovers) by
  itself.

Whatever the deployment, the client is set up the way the stores need it (stores.py): every call
bounded by the timeout (connecting, each reply, the wait for a pooled connection), a blocking
pool of at most `max_connections` connections (per node, in a cluster), and no retries inside
redis-py (a write retried after a timeout could land twice; redirections, which mean the node
refused the command, are still followed). The client is made on first use, so a cluster that is
down when the server starts costs what a single Redis down costs, not a failed start.
"""

from __future__ import annotations

from xlserve.server.redis_urls import RedisTarget, parse_redis_url


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
