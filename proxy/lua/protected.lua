-- One page of the sessions whose TTL deadline is still ahead, with the fields the retention
-- worker reads: its mirror is loaded (and reloaded after a gap) this way, page by page, and
-- then follows the change feed (feed.lua). Session keys are derived from the namespace prefix
-- (single-instance / Sentinel Redis, as free.lua).
-- KEYS[1] deadline ZSET  ARGV[1] now  ARGV[2] limit  ARGV[3] key prefix  ARGV[4] offset
-- ARGV[5] "1": tenants are hash tags in key names (a cluster)  ARGV[6..] fields
-- Returns a flat list: per session its tenant, then one value per field (nil when unset);
-- sessions whose hash is gone are left out.
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
local members = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf', 'LIMIT', ARGV[4], ARGV[2])
local out = {}
for _, member in ipairs(members) do
  local sep = string.find(member, '\31', 1, true)
  if sep then
    local tenant, sid = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
    local t = ARGV[5] == '1' and ('{' .. tenant .. '}') or tenant
    local values = redis.call('HMGET', ARGV[3] .. ':s:' .. t .. ':' .. sid, unpack(fields))
    if values[1] then
      out[#out + 1] = tenant
      for i = 1, #fields do out[#out + 1] = values[i] end
    end
  end
end
return out
