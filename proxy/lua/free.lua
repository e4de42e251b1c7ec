-- Free a session, or its whole tree with children before parents (post-order).
-- Session keys are derived from the namespace prefix and the tenant as key names write it
-- (its hash tag on a cluster: all in the slot of the declared keys).
-- KEYS[1] tenant index ZSET  KEYS[2] deadline ZSET  KEYS[3] change feed ZSET  KEYS[4] feed sequence
-- ARGV[1] key prefix (e.g. "kvk")  ARGV[2] tenant  ARGV[3] sid  ARGV[4] "1" = whole tree
-- ARGV[5] max sessions to free in one call  ARGV[6] the tenant in key names
-- Returns the freed session ids in the order they were freed (empty when not found).
local prefix, tenant, root = ARGV[1], ARGV[2], ARGV[3]
local function key(kind, sid) return prefix .. ':' .. kind .. ':' .. ARGV[6] .. ':' .. sid end
if redis.call('EXISTS', key('s', root)) == 0 then return {} end
local order = {}
if ARGV[4] == '1' then
  local limit = tonumber(ARGV[5])
  local seen = {[root] = true}
  local stack = {{root, false}}
  while #stack > 0 do
    local top = stack[#stack]
    if top[2] then
      table.remove(stack)
      order[#order + 1] = top[1]
    else
      top[2] = true
      for _, child in ipairs(redis.call('SMEMBERS', key('ch', top[1]))) do
        if not seen[child] and #order + #stack < limit then
          seen[child] = true
          stack[#stack + 1] = {child, false}
        end
      end
    end
  end
else
  order[1] = root
  for _, child in ipairs(redis.call('SMEMBERS', key('ch', root))) do
    redis.call('HDEL', key('s', child), 'parent')  -- orphans keep their own state
  end
end
local idx, dl, feed, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
for _, sid in ipairs(order) do
  local parent = redis.call('HGET', key('s', sid), 'parent')
  if parent then redis.call('SREM', key('ch', parent), sid) end
  redis.call('DEL', key('s', sid), key('ch', sid), key('ctx', sid), key('blk', sid))
  redis.call('ZREM', idx, sid)
  redis.call('ZREM', dl, tenant .. '\31' .. sid)
  redis.call('ZADD', feed, redis.call('INCR', seq), tenant .. '\31' .. sid)
end
return order
