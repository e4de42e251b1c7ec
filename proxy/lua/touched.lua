-- Record a keep-alive touch or warm-up (never resurrects a freed session).
-- KEYS[1] session hash  KEYS[2] change feed ZSET  KEYS[3] feed sequence
-- ARGV[1] now  ARGV[2] counter prefix ("touch" or "warmup")  ARGV[3] recomputed tokens
-- ARGV[4] deadline member
-- Returns 1 when recorded.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'last_touch', ARGV[1])
redis.call('HINCRBY', KEYS[1], ARGV[2] == 'touch' and 'touches' or 'warmups', 1)
redis.call('HINCRBY', KEYS[1], ARGV[2] .. '_tokens', ARGV[3])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), ARGV[4])
return 1
