"""A namespace's ledger in Redis, beside the pages: each call one Lua script, atomic on the server.

The ledger's five keys share one hash tag, so a Redis Cluster keeps them in one slot and runs a
script over all of them (the pages themselves stay spread over the cluster). Their names start
with ``<namespace>:quota:`` and hold a second ``:``, so they are never mistaken for a page of the
namespace (page names have none after the namespace's) and ``clear()`` leaves them alone:

* ``pages``: sorted set of page keys by the time each was last used;
* ``sizes``: hash of page key to bytes;
* ``holds`` / ``held``: sorted set of hold ids by expiry, and hash of hold id to bytes;
* ``used``: the bytes of ``pages``.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from typing import Any

from hicache_storage.errors import BackendTimeoutError, BackendUnavailableError

from .ledger import Grant, LedgerUsage

__all__ = ["RedisLedger"]

_EXPIRE_AND_TOUCH = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[1])
for _, id in ipairs(expired) do
  redis.call('HDEL', KEYS[4], id)
  redis.call('ZREM', KEYS[3], id)
end
for i = ARGV_TOUCH, #ARGV, 2 do
  local old = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if old and tonumber(old) < tonumber(ARGV[i + 1]) then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[i + 1], ARGV[i])
  end
end
"""

_HELD = """
local held = 0
for _, v in ipairs(redis.call('HVALS', KEYS[4])) do held = held + tonumber(v) end
"""

# ARGV: now, nbytes, quota, target, expires, hold, evicting, then touched (key, time) pairs.
_RESERVE = (
    _EXPIRE_AND_TOUCH.replace("ARGV_TOUCH", "8")
    + _HELD
    + """
local n = tonumber(ARGV[2])
local quota = tonumber(ARGV[3])
if n > quota then return {0} end
local used = tonumber(redis.call('GET', KEYS[5]) or '0')
local taken = used + held + n
if taken <= quota then
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6])
  redis.call('HSET', KEYS[4], ARGV[6], n)
  return {1}
end
for _, id in ipairs(redis.call('HKEYS', KEYS[4])) do
  if string.sub(id, 1, 1) == 'e' then return {0} end
end
local need = taken - tonumber(ARGV[4])
local victims = {}
local freed = 0
local start = 0
while freed < need do
  local batch = redis.call('ZRANGE', KEYS[1], start, start + 63)
  if #batch == 0 then break end
  for _, key in ipairs(batch) do
    if freed >= need then break end
    local size = tonumber(redis.call('HGET', KEYS[2], key) or '0')
    victims[#victims + 1] = key
    victims[#victims + 1] = size
    freed = freed + size
  end
  start = start + 64
end
if taken - freed > quota then return {0} end
for i = 1, #victims, 2 do
  redis.call('ZREM', KEYS[1], victims[i])
  redis.call('HDEL', KEYS[2], victims[i])
end
redis.call('DECRBY', KEYS[5], freed)
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6], ARGV[5], ARGV[7])
redis.call('HSET', KEYS[4], ARGV[6], n, ARGV[7], freed)
local answer = {1}
for _, v in ipairs(victims) do answer[#answer + 1] = v end
return answer
"""
)

# ARGV: hold, now, then stored (key, nbytes) pairs.
_SETTLE = """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
local added = 0
for i = 3, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    added = added + tonumber(ARGV[i + 1])
  end
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i])
end
redis.call('INCRBY', KEYS[5], added)
return added
"""

# ARGV: the keys to take out; returns (key, nbytes) of those it held.
_FORGET = """
local gone = 0
local answer = {}
for _, key in ipairs(ARGV) do
  local size = redis.call('HGET', KEYS[2], key)
  if size then
    gone = gone + tonumber(size)
    answer[#answer + 1] = key
    answer[#answer + 1] = size
    redis.call('HDEL', KEYS[2], key)
    redis.call('ZREM', KEYS[1], key)
  end
end
redis.call('DECRBY', KEYS[5], gone)
return answer
"""

_TOUCH = _EXPIRE_AND_TOUCH.replace("ARGV_TOUCH", "2") + "return 0"

# ARGV: now.
_USAGE = """
local live = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], ARGV[1], '+inf')) do
  live = live + tonumber(redis.call('HGET', KEYS[4], id) or '0')
end
return {tonumber(redis.call('GET', KEYS[5]) or '0'), live, redis.call('ZCARD', KEYS[1])}
"""


class RedisLedger:
    """:class:`~hicache_storage.quota.QuotaLedger` in Redis (``client``: redis-py, cluster too).

    ``namespace`` is the pages' namespace (their names are ``<namespace>:<key>``). The ledger
    owns ``client`` (:meth:`close` closes it). Errors of the client become
    :class:`~hicache_storage.errors.BackendError` subclasses.
    """

    def __init__(self, client: Any, namespace: str) -> None:
        self._client = client
        tag = hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()
        base = f"{namespace}:quota:{{{tag}}}:"
        self.keys = [base + part for part in ("pages", "sizes", "holds", "held", "used")]
        self._scripts = {
            name: client.register_script(body)
            for name, body in (
                ("reserve", _RESERVE),
                ("settle", _SETTLE),
                ("forget", _FORGET),
                ("touch", _TOUCH),
                ("usage", _USAGE),
            )
        }

    def _run(self, name: str, args: Sequence[object]) -> Any:
        import redis

        try:
            return self._scripts[name](keys=self.keys, args=list(args))
        except redis.TimeoutError as exc:
            raise BackendTimeoutError(f"quota ledger {name}: {exc}") from exc
        except redis.RedisError as exc:
            raise BackendUnavailableError(f"quota ledger {name}: {exc}") from exc

    def reserve(
        self,
        nbytes: int,
        *,
        quota: int,
        target: int,
        now: float,
        hold_s: float,
        touched: Sequence[tuple[str, float]] = (),
    ) -> Grant | None:
        """See :meth:`QuotaLedger.reserve`."""
        hold, evicting = "w" + uuid.uuid4().hex, "e" + uuid.uuid4().hex
        args: list[object] = [repr(now), nbytes, quota, target, repr(now + hold_s), hold, evicting]
        for key, when in touched:
            args += [key, repr(when)]
        answer = self._run("reserve", args)
        if not int(answer[0]):
            return None
        rest = answer[1:]
        victims = [(_text(rest[i]), int(rest[i + 1])) for i in range(0, len(rest), 2)]
        return Grant(hold, victims, evicting if victims else None)

    def settle(self, hold: str, stored: Sequence[tuple[str, int]], *, now: float) -> None:
        """See :meth:`QuotaLedger.settle`."""
        args: list[object] = [hold, repr(now)]
        for key, size in stored:
            args += [key, size]
        self._run("settle", args)

    def release(self, hold: str) -> None:
        """See :meth:`QuotaLedger.release`."""
        self._run("settle", [hold, "0"])

    def touch(self, touched: Sequence[tuple[str, float]]) -> None:
        """See :meth:`QuotaLedger.touch` (expired holds are dropped on the way)."""
        if not touched:
            return
        args: list[object] = [repr(max(when for _, when in touched))]
        for key, when in touched:
            args += [key, repr(when)]
        self._run("touch", args)

    def forget(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """See :meth:`QuotaLedger.forget`."""
        if not keys:
            return []
        answer = self._run("forget", list(keys))
        return [(_text(answer[i]), int(answer[i + 1])) for i in range(0, len(answer), 2)]

    def clear(self) -> None:
        """See :meth:`QuotaLedger.clear`."""
        import redis

        try:
            self._client.delete(self.keys[0], self.keys[1], self.keys[4])
        except redis.RedisError as exc:
            raise BackendUnavailableError(f"quota ledger clear: {exc}") from exc

    def usage(self, *, now: float) -> LedgerUsage:
        """See :meth:`QuotaLedger.usage`."""
        used, held, pages = self._run("usage", [repr(now)])
        return LedgerUsage(used_bytes=int(used), held_bytes=int(held), pages=int(pages))

    def close(self) -> None:
        """See :meth:`QuotaLedger.close`: closes ``client``, which the ledger owns."""
        self._client.close()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
