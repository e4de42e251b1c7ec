-- Create or refresh a session on the request hot path, link it to its parent, set its TTL.
-- One round trip; rejections happen before any write, so a rejected hint changes nothing.
-- Several sessions in one call (the upserts of known sessions' repeats, written behind): 10 keys
-- and 13 arguments per session, one after the other, and a list of replies (one session: its
-- reply alone).
-- KEYS[1] session hash      KEYS[2] tenant index ZSET (sid by last_seen)   KEYS[3] deadline ZSET
-- KEYS[4] parent hash ("" when no parent)   KEYS[5] parent's children SET ("" when no parent)
-- KEYS[6] tenants SET       KEYS[7] own children SET   KEYS[8] own context STRING
-- KEYS[9] change feed ZSET (deadline member by sequence)   KEYS[10] feed sequence counter
-- ARGV[1] now  ARGV[2] sid  ARGV[3] tenant  ARGV[4] parent sid or ""  ARGV[5] agent or ""
-- ARGV[6] ttl seconds or "" (no change)  ARGV[7] retention  ARGV[8] max sessions per tenant
-- ARGV[9] max children  ARGV[10] safety expiry seconds  ARGV[11] deadline member  ARGV[12] stale cutoff
-- ARGV[13] requests this call stands for (several repeats of a known session, written behind)
-- Returns {status, created, engine, parent_engine, last_active, last_prompt_tokens} as they were
-- before this request; status "ok" or a rejection reason.
local function upsert(KEYS, ARGV)
  local now = tonumber(ARGV[1])
  local parent = ARGV[4]
  local exists = redis.call('EXISTS', KEYS[1]) == 1
  local before = exists and redis.call('HMGET', KEYS[1], 'last_used', 'last_touch', 'last_prompt_tokens')
    or {false, false, false}
  local last_active = math.max(tonumber(before[1] or '0'), tonumber(before[2] or '0'))
  local parent_exists = parent ~= '' and redis.call('EXISTS', KEYS[4]) == 1
  local new_sessions = (exists and 0 or 1) + ((parent ~= '' and not parent_exists) and 1 or 0)
  if new_sessions > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[12])  -- entries whose hashes expired
    if redis.call('ZCARD', KEYS[2]) + new_sessions > tonumber(ARGV[8]) then
      return {'max_sessions', 0, '', ''}
    end
  end
  if parent ~= '' then
    local current = exists and redis.call('HGET', KEYS[1], 'parent') or false
    if current and current ~= parent then return {'parent_mismatch', 0, '', ''} end
    if redis.call('SISMEMBER', KEYS[5], ARGV[2]) == 0
       and redis.call('SCARD', KEYS[5]) >= tonumber(ARGV[9]) then
      return {'max_children', 0, '', ''}
    end
  end
  local fresh = {'tenant', ARGV[3], 'session_id', ARGV[2], 'created', now, 'state', 'active',
    'requests', 0, 'prompt_tokens', 0, 'cached_tokens', 0, 'completion_tokens', 0,
    'touches', 0, 'touch_tokens', 0, 'ttl_until', 0}
  if not exists then
    redis.call('HSET', KEYS[1], unpack(fresh))
    redis.call('SADD', KEYS[6], ARGV[3])
  end
  local expiry = tonumber(ARGV[10])
  local parent_engine = ''
  if parent ~= '' then
    if not parent_exists then
      redis.call('HSET', KEYS[4], unpack(fresh))
      redis.call('HSET', KEYS[4], 'session_id', parent, 'state', 'idle', 'last_seen', now)
      redis.call('ZADD', KEYS[2], now, parent)
    end
    parent_engine = redis.call('HGET', KEYS[4], 'engine') or ''
    redis.call('SADD', KEYS[5], ARGV[2])
    redis.call('HSET', KEYS[1], 'parent', parent)
    redis.call('EXPIRE', KEYS[4], expiry)
    redis.call('EXPIRE', KEYS[5], expiry)
    -- a parent waiting on its children stays protected while they run: each child request
    -- re-arms the parent's own TTL (never longer than that TTL from now)
    local parent_ttl = tonumber(redis.call('HGET', KEYS[4], 'ttl') or '0')
    local parent_until = tonumber(redis.call('HGET', KEYS[4], 'ttl_until') or '0')
    if parent_ttl > 0 and parent_until > 0 and now + parent_ttl > parent_until then
      redis.call('HSET', KEYS[4], 'ttl_until', now + parent_ttl)
      redis.call('ZADD', KEYS[3], now + parent_ttl, ARGV[3] .. '\31' .. parent)
      redis.call('ZADD', KEYS[9], redis.call('INCR', KEYS[10]), ARGV[3] .. '\31' .. parent)
    end
  end
  redis.call('HSET', KEYS[1], 'last_seen', now, 'state', 'active', 'retention', ARGV[7])
  redis.call('HINCRBY', KEYS[1], 'requests', tonumber(ARGV[13] or '1'))
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'agent', ARGV[5]) end
  if ARGV[6] ~= '' then
    local ttl = tonumber(ARGV[6])
    if ttl > 0 then
      redis.call('HSET', KEYS[1], 'ttl', ttl, 'ttl_until', now + ttl)
      redis.call('ZADD', KEYS[3], now + ttl, ARGV[11])
      if now + ttl + 60 > expiry then expiry = math.ceil(ttl + 60 + expiry) end
    else
      redis.call('HSET', KEYS[1], 'ttl', 0, 'ttl_until', 0)
      redis.call('ZREM', KEYS[3], ARGV[11])
    end
  end
  redis.call('ZADD', KEYS[2], now, ARGV[2])
  -- the retention workers follow protected sessions through the change feed (store.protected)
  if ARGV[6] ~= '' or tonumber(redis.call('HGET', KEYS[1], 'ttl_until') or '0') > 0 then
    redis.call('ZADD', KEYS[9], redis.call('INCR', KEYS[10]), ARGV[11])
  end
  redis.call('EXPIRE', KEYS[1], expiry)
  redis.call('EXPIRE', KEYS[2], expiry)
  redis.call('EXPIRE', KEYS[7], expiry)
  redis.call('EXPIRE', KEYS[8], expiry)
  local engine = redis.call('HGET', KEYS[1], 'engine') or ''
  return {'ok', exists and 0 or 1, engine, parent_engine, tostring(last_active), before[3] or '0'}
end

local n = #KEYS / 10
if n == 1 then return upsert(KEYS, ARGV) end
local replies = {}
for i = 0, n - 1 do
  local keys, args = {}, {}
  for j = 1, 10 do keys[j] = KEYS[10 * i + j] end
  for j = 1, 13 do args[j] = ARGV[13 * i + j] end
  replies[i + 1] = upsert(keys, args)
end
return replies
