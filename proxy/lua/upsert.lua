-- Create or refresh a session on the request hot path, link it to its parent, set its TTL.
-- One round trip; rejections happen before any write, so a rejected hint changes nothing.
-- Several sessions in one call (the upserts of known sessions' repeats, written behind): 10 keys
-- and 13 arguments per session, one after the other, and a list of replies (one session: its
-- reply alone, unless brief replies are asked for, see the end).
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
-- A session's keys and arguments are read at offsets (k, a) into KEYS and ARGV.
local function upsert(k, a)
  local now = tonumber(ARGV[a + 1])
  local sid, tenant, parent = ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local own, index, member = KEYS[k + 1], KEYS[k + 2], ARGV[a + 11]
  local exists = redis.call('EXISTS', own) == 1
  -- the upsert never writes 'engine': read with the rest, as it was before this request
  local before = exists and redis.call('HMGET', own, 'last_used', 'last_touch', 'last_prompt_tokens', 'engine')
    or {false, false, false, false}
  local last_active = math.max(tonumber(before[1] or '0'), tonumber(before[2] or '0'))
  local parent_exists = parent ~= '' and redis.call('EXISTS', KEYS[k + 4]) == 1
  local new_sessions = (exists and 0 or 1) + ((parent ~= '' and not parent_exists) and 1 or 0)
  if new_sessions > 0 then
    redis.call('ZREMRANGEBYSCORE', index, '-inf', ARGV[a + 12])  -- entries whose hashes expired
    if redis.call('ZCARD', index) + new_sessions > tonumber(ARGV[a + 8]) then
      return {'max_sessions', 0, '', ''}
    end
  end
  if parent ~= '' then
    local current = exists and redis.call('HGET', own, 'parent') or false
    if current and current ~= parent then return {'parent_mismatch', 0, '', ''} end
    if redis.call('SISMEMBER', KEYS[k + 5], sid) == 0
       and redis.call('SCARD', KEYS[k + 5]) >= tonumber(ARGV[a + 9]) then
      return {'max_children', 0, '', ''}
    end
  end
  local fresh = nil
  if new_sessions > 0 then
    fresh = {'tenant', tenant, 'session_id', sid, 'created', now, 'state', 'active',
      'requests', 0, 'prompt_tokens', 0, 'cached_tokens', 0, 'completion_tokens', 0,
      'touches', 0, 'touch_tokens', 0, 'ttl_until', 0}
  end
  if not exists then
    redis.call('HSET', own, unpack(fresh))
    redis.call('SADD', KEYS[k + 6], tenant)
  end
  local expiry = tonumber(ARGV[a + 10])
  local parent_engine = ''
  if parent ~= '' then
    local pkey, children = KEYS[k + 4], KEYS[k + 5]
    if not parent_exists then
      redis.call('HSET', pkey, unpack(fresh))
      redis.call('HSET', pkey, 'session_id', parent, 'state', 'idle', 'last_seen', now)
      redis.call('ZADD', index, now, parent)
    end
    parent_engine = redis.call('HGET', pkey, 'engine') or ''
    redis.call('SADD', children, sid)
    redis.call('HSET', own, 'parent', parent)
    redis.call('EXPIRE', pkey, expiry)
    redis.call('EXPIRE', children, expiry)
    -- a parent waiting on its children stays protected while they run: each child request
    -- re-arms the parent's own TTL (never longer than that TTL from now)
    local parent_ttl = tonumber(redis.call('HGET', pkey, 'ttl') or '0')
    local parent_until = tonumber(redis.call('HGET', pkey, 'ttl_until') or '0')
    if parent_ttl > 0 and parent_until > 0 and now + parent_ttl > parent_until then
      redis.call('HSET', pkey, 'ttl_until', now + parent_ttl)
      redis.call('ZADD', KEYS[k + 3], now + parent_ttl, tenant .. '\31' .. parent)
      redis.call('ZADD', KEYS[k + 9], redis.call('INCR', KEYS[k + 10]), tenant .. '\31' .. parent)
    end
  end
  -- one HSET for what every request writes (activity, retention, agent, TTL)
  local fields = {'last_seen', now, 'state', 'active', 'retention', ARGV[a + 7]}
  if ARGV[a + 5] ~= '' then
    fields[#fields + 1] = 'agent'
    fields[#fields + 1] = ARGV[a + 5]
  end
  local ttl = ARGV[a + 6] ~= '' and tonumber(ARGV[a + 6]) or nil
  if ttl ~= nil then  -- 0: stop protecting
    fields[#fields + 1] = 'ttl'
    fields[#fields + 1] = ttl > 0 and ttl or 0
    fields[#fields + 1] = 'ttl_until'
    fields[#fields + 1] = ttl > 0 and now + ttl or 0
    fields[#fields + 1] = 'guessed'  -- the client's own TTL: no longer kvkeeper's guess
    fields[#fields + 1] = 0
  end
  redis.call('HSET', own, unpack(fields))
  redis.call('HINCRBY', own, 'requests', tonumber(ARGV[a + 13] or '1'))
  if ttl ~= nil then
    if ttl > 0 then
      redis.call('ZADD', KEYS[k + 3], now + ttl, member)
      if now + ttl + 60 > expiry then expiry = math.ceil(ttl + 60 + expiry) end
    else
      redis.call('ZREM', KEYS[k + 3], member)
    end
  end
  redis.call('ZADD', index, now, sid)
  -- the retention workers follow protected sessions through the change feed (store.protected)
  if ttl ~= nil or tonumber(redis.call('HGET', own, 'ttl_until') or '0') > 0 then
    redis.call('ZADD', KEYS[k + 9], redis.call('INCR', KEYS[k + 10]), member)
  end
  redis.call('EXPIRE', own, expiry)
  redis.call('EXPIRE', index, expiry)
  redis.call('EXPIRE', KEYS[k + 7], expiry)
  redis.call('EXPIRE', KEYS[k + 8], expiry)
  return {'ok', exists and 0 or 1, before[4] or '', parent_engine, tostring(last_active), before[3] or '0'}
end

local n = #KEYS / 10
-- one more argument after the sessions' own: brief replies, 1 (created), 0 or the rejection
local brief = #ARGV > 13 * n
if n == 1 and not brief then return upsert(0, 0) end
local replies = {}
for i = 0, n - 1 do
  local reply = upsert(10 * i, 13 * i)
  if brief then reply = reply[1] == 'ok' and reply[2] or reply[1] end
  replies[i + 1] = reply
end
return replies
