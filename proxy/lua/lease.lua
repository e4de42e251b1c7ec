-- Acquire or renew the lease that makes one proxy replica the driver of one engine.
-- The fencing token grows with every new holder, so a deposed holder can tell.
-- KEYS[1] lease STRING  KEYS[2] fence counter
-- ARGV[1] holder id  ARGV[2] lease ttl in ms
-- Returns the fencing token while ARGV[1] holds the lease, 0 when another replica does.
local current = redis.call('GET', KEYS[1])
if not current then
  local token = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
  return token
end
local holder, token = string.match(current, '^(.*)|(%d+)$')
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(token)
end
return 0
