-- Undo the creation of a session whose only request failed upstream (the engine refused it
-- or no engine answered): a session no request was served for is not kept. Left alone when
-- another request has used it since (requests > 1, or a completion recorded).
-- KEYS[1] session hash  KEYS[2] tenant index ZSET  KEYS[3] deadline ZSET
-- KEYS[4] own children SET  KEYS[5] own context STRING  KEYS[6] parent's children SET or ""
-- KEYS[7] change feed ZSET  KEYS[8] feed sequence
-- A session that is kept loses the 'active' state the failed request gave it (protected while
-- its TTL runs, else idle), as a finished request would leave it.
-- ARGV[1] sid  ARGV[2] deadline member  ARGV[3] now
-- Returns 1 when the session was removed.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local requests, used, state, ttl_until = unpack(
  redis.call('HMGET', KEYS[1], 'requests', 'last_used', 'state', 'ttl_until'))
if tonumber(requests or '0') > 1 or used or redis.call('SCARD', KEYS[4]) > 0 then
  if state == 'active' then
    local until_ = tonumber(ttl_until or '0')
    redis.call('HSET', KEYS[1], 'state', until_ > tonumber(ARGV[3]) and 'protected' or 'idle')
    if until_ > 0 then redis.call('ZADD', KEYS[7], redis.call('INCR', KEYS[8]), ARGV[2]) end
  end
  return 0
end
redis.call('DEL', KEYS[1], KEYS[4], KEYS[5])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[7], redis.call('INCR', KEYS[8]), ARGV[2])
if KEYS[6] ~= '' then redis.call('SREM', KEYS[6], ARGV[1]) end
return 1
