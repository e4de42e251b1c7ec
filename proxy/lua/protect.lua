-- Change a session's protection from an edit or an admin call.
-- KEYS[1] session hash  KEYS[2] deadline ZSET  KEYS[3] change feed ZSET  KEYS[4] feed sequence
-- ARGV[1] now  ARGV[2] ttl seconds (0 = stop protecting)  ARGV[3] new state or ""
-- ARGV[4] deadline member  ARGV[5] "1" = forget engine affinity (dead for routing)
-- ARGV[6] "1" = the protection is kvkeeper's guess (policy/returns.py), not asked by a client
-- Returns 1 when the session exists.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
if ttl > 0 then
  redis.call('HSET', KEYS[1], 'ttl', ttl, 'ttl_until', now + ttl, 'guessed', ARGV[6] == '1' and 1 or 0)
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
  if redis.call('TTL', KEYS[1]) < ttl + 60 then redis.call('EXPIRE', KEYS[1], math.ceil(ttl + 60)) end
else
  redis.call('HSET', KEYS[1], 'ttl_until', 0)
  redis.call('ZREM', KEYS[2], ARGV[4])
end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'state', ARGV[3]) end
if ARGV[5] == '1' then redis.call('HDEL', KEYS[1], 'engine') end
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), ARGV[4])
return 1
