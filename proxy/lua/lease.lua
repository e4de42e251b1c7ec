-- Acquire or renew the lease that makes one proxy replica the driver of one engine.
-- The fencing token grows with every new holder, so a deposed holder can tell. It is at least
-- Redis' clock in microseconds: a Redis that lost its data (restart without persistence, a
-- failover to a replica that missed the last writes) still never hands out a smaller token.
-- KEYS[1] lease STRING  KEYS[2] fence counter
-- ARGV[1] holder id  ARGV[2] lease ttl in ms
-- Returns the fencing token while ARGV[1] holds the lease, 0 when another replica does.
local current = redis.call('GET', KEYS[1])
if not current then
  local t = redis.call('TIME')
  local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local token = math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + 1, floor)
  redis.call('SET', KEYS[2], string.format('%d', token))
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. string.format('%d', token), 'PX', ARGV[2])
  return token
end
local holder, token = string.match(current, '^(.*)|(%d+)$')
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(token)
end
return 0
