-- Expire one TTL if its deadline has passed (idempotent: a refreshed TTL is left alone).
-- KEYS[1] session hash  KEYS[2] deadline ZSET  KEYS[3] change feed ZSET  KEYS[4] feed sequence
-- ARGV[1] now  ARGV[2] deadline member
-- Returns 1 when this call expired it, 0 otherwise.
local now = tonumber(ARGV[1])
local ttl_until = tonumber(redis.call('HGET', KEYS[1], 'ttl_until') or '0')
if ttl_until > now then return 0 end
redis.call('ZREM', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 or ttl_until == 0 then return 0 end
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), ARGV[2])
redis.call('HSET', KEYS[1], 'ttl_until', 0)
if redis.call('HGET', KEYS[1], 'state') == 'protected' then
  redis.call('HSET', KEYS[1], 'state', 'idle')
end
redis.call('HINCRBY', KEYS[1], 'expiries', 1)
return 1
