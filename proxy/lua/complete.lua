-- Record finished requests in one call: engine affinity, usage counters, state, and the context
-- to re-touch. Records are per session, already merged by the proxy (counters are sums; the
-- "last" fields and the context are the latest request's). Never resurrects a session freed
-- while its request ran.
-- KEYS[1] change feed ZSET  KEYS[2] feed sequence; then per record i (0-based):
--   [3i+3] session hash  [3i+4] context STRING  [3i+5] tenant index
-- ARGV[1] safety expiry seconds; then 10 per record: now, engine, last prompt tokens,
--   last cached tokens, prompt tokens, cached tokens, completion tokens, context blob or "", sid,
--   deadline member
-- Returns the number of records written (sessions that still existed).
local min_expiry = tonumber(ARGV[1])
local written = 0
for i = 0, (#KEYS - 2) / 3 - 1 do
  local s, ctx, idx = KEYS[3 * i + 3], KEYS[3 * i + 4], KEYS[3 * i + 5]
  local a = 1 + 10 * i
  if redis.call('EXISTS', s) == 1 then
    local now = tonumber(ARGV[a + 1])
    redis.call('HSET', s, 'engine', ARGV[a + 2], 'last_used', now,
      'last_prompt_tokens', ARGV[a + 3], 'last_cached_tokens', ARGV[a + 4])
    redis.call('HINCRBY', s, 'prompt_tokens', ARGV[a + 5])
    redis.call('HINCRBY', s, 'cached_tokens', ARGV[a + 6])
    redis.call('HINCRBY', s, 'completion_tokens', ARGV[a + 7])
    local ttl_until = tonumber(redis.call('HGET', s, 'ttl_until') or '0')
    if redis.call('HGET', s, 'state') == 'active' then
      redis.call('HSET', s, 'state', ttl_until > now and 'protected' or 'idle')
    end
    if ARGV[a + 8] ~= '' then
      redis.call('SET', ctx, ARGV[a + 8], 'EX', math.max(min_expiry, redis.call('TTL', s)))
    end
    redis.call('ZADD', idx, now, ARGV[a + 9])
    if ttl_until > 0 then redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[2]), ARGV[a + 10]) end
    written = written + 1
  end
end
return written
