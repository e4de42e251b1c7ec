-- Record a finished request: engine affinity, usage counters, state, and the context to re-touch.
-- Never resurrects a session freed while its request ran.
-- KEYS[1] session hash  KEYS[2] context STRING  KEYS[3] tenant index ZSET
-- ARGV[1] now  ARGV[2] engine  ARGV[3] prompt tokens  ARGV[4] cached tokens
-- ARGV[5] completion tokens  ARGV[6] context blob or ""  ARGV[7] safety expiry seconds  ARGV[8] sid
-- Returns 1 when recorded, 0 when the session no longer exists.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local now = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'engine', ARGV[2], 'last_used', now,
  'last_prompt_tokens', ARGV[3], 'last_cached_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5])
local ttl_until = tonumber(redis.call('HGET', KEYS[1], 'ttl_until') or '0')
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'active' then
  redis.call('HSET', KEYS[1], 'state', ttl_until > now and 'protected' or 'idle')
end
local expiry = math.max(tonumber(ARGV[7]), redis.call('TTL', KEYS[1]))
if ARGV[6] ~= '' then
  redis.call('SET', KEYS[2], ARGV[6], 'EX', expiry)
end
redis.call('ZADD', KEYS[3], now, ARGV[8])
return 1
